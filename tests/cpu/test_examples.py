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


@needs_build
def test_the_transformers_backend_without_a_gpu():
    """examples/transformers_backend.py where there is no GPU: kgen registers as an
    attention implementation; a model loaded with it has the eager model's weights; on
    meta tensors its prefill and a decode step run through torch.ops.kgen's fake
    kernels, each layer storing its step's rows (reshape_and_cache) and attending over
    its pages (paged_attention: the step's rows, the sequence's keys so far); on CPU
    tensors kgen refuses the first call (ContractError)."""
    import warnings

    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AttentionInterface

    from kgen.runtime import ContractError

    ex = load("transformers_backend")
    mine, eager = ex.models(seed=0, device="cpu")
    assert AttentionInterface._global_mapping["kgen"] is ex.attention
    assert mine.config._attn_implementation == "kgen"
    assert eager.config._attn_implementation == "eager"
    for (n, a), (m, b) in zip(mine.state_dict().items(), eager.state_dict().items(),
                              strict=True):
        assert n == m and torch.equal(a, b), n
    prompt = torch.randint(0, ex.VOCAB, (ex.BATCH, ex.PROMPT))
    with pytest.raises(ContractError) as e:
        ex.greedy(mine, prompt, 1)
    assert e.value.contract == "device"

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name.startswith("kgen."):
                self.seen.append((name.removesuffix(".default"), args))
            return func(*args, **(kwargs or {}))

    meta = mine.to("meta")
    B, S = ex.BATCH, ex.PROMPT
    with torch.no_grad(), Calls() as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = meta(input_ids=prompt.to("meta"), use_cache=True)
        step = meta(input_ids=torch.zeros((B, 1), dtype=torch.long, device="meta"),
                    past_key_values=out.past_key_values, use_cache=True)
    assert tuple(out.logits.shape) == (B, S, ex.VOCAB)
    assert tuple(step.logits.shape) == (B, 1, ex.VOCAB)
    names = [n for n, _ in calls.seen]
    assert names == ["kgen.reshape_and_cache", "kgen.paged_attention"] * (2 * ex.LAYERS)
    for i, (rows, keys) in enumerate([(S, S)] * ex.LAYERS + [(1, S + 1)] * ex.LAYERS):
        (_, store), (_, attend) = calls.seen[2 * i: 2 * i + 2]
        key, value, key_cache, value_cache, slots = store
        assert tuple(key.shape) == (B * rows, ex.KV_HEADS, ex.HEAD_DIM)
        assert tuple(slots.shape) == (B * rows,)
        query, kc, vc, qsl, lens, table, slots2, max_q, max_k = attend[:9]
        assert kc is key_cache and vc is value_cache and slots2 is slots
        assert tuple(query.shape) == (B * rows, ex.HEADS, ex.HEAD_DIM)
        assert (max_q, max_k) == (rows, keys)
        assert tuple(qsl.shape) == (B + 1,) and tuple(table.shape)[0] == B
