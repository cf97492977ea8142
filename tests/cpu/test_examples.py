"""The examples/ scripts without a GPU: the engine loop runs under a stand-in for CuPy
(every call checked against its contracts, every launch recorded), so the example keeps
to the API as it is; the GPU suite runs the examples for real (tests/gpu/test_examples_gpu.py)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from kgen.runtime import engine, tuned
from kgen.testing.built import needs_build
from kgen.testing.fakecupy import FakeCupy

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_build
@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_the_engine_loop_keeps_to_the_api(monkeypatch, kv):
    monkeypatch.setattr(tuned, "tuned", lambda *a: None)
    monkeypatch.setattr(tuned, "tuned_prefill", lambda *a: None)
    monkeypatch.setattr(engine, "_KERNELS", {})
    monkeypatch.setattr(engine, "_SCRATCH", {})
    cp = FakeCupy().install(monkeypatch)
    loop = load("engine_loop")
    steps = loop.run(cp, kv=kv)
    chunks = -(-max(loop.PROMPTS) // loop.CHUNK)
    assert len(steps) == chunks + loop.NEW_TOKENS
    assert tuple(steps[-1].shape) == (len(loop.PROMPTS), loop.HEADS, loop.HEAD_DIM)
    # every layer of every step stores its rows and attends: at least two launches each
    assert len(cp.launched) >= 2 * loop.LAYERS * len(steps)


def test_every_example_parses_and_names_only_kgen_exports():
    """Each example is valid Python whose kgen.X names exist."""
    import kgen

    for path in sorted(EXAMPLES.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                 and isinstance(n.value, ast.Name) and n.value.id == "kgen"}
        for name in names:
            assert hasattr(kgen, name), f"{path.name}: kgen.{name} does not exist"
