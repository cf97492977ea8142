"""The examples/ scripts on a GPU, run as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["engine_loop", "torch_quickstart", "transformers_backend"])
def test_example_runs(name):
    """Each example as a user runs it: it exits 0 and its last line says True (finite
    output; for transformers_backend, after it asserted kgen's greedy tokens equal to
    transformers' eager attention's)."""
    if name != "engine_loop":
        pytest.importorskip("torch")
    if name == "transformers_backend":
        pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "True" in done.stdout, done.stdout  # its output is finite
