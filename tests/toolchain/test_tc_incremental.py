"""Changing one spec recompiles only the module it feeds; the rest are cache hits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tc_helpers import repo_context

from kgen.compiler import pipeline
from kgen.toolchain.locate import Toolchain

ROOT = Path(__file__).resolve().parents[2]
# The build's stages up to the compiled modules (no outputs written).
COMPILE = ("parse", "check", "render", "ptx", "cubin")


@pytest.mark.toolchain
def test_one_spec_change_recompiles_only_its_module(tmp_path, monkeypatch):
    specs = tmp_path / "specs"
    shutil.copytree(ROOT / "specs", specs)
    ctx = repo_context(tmp_path / "cache")
    modules = {k.module for k in pipeline.checked(pipeline.parse([specs]))}

    def build() -> list[str]:
        calls: list[str] = []
        real = Toolchain.run

        def counting(self, argv, cwd=None):
            calls.append(Path(argv[-1]).stem if argv[0] != self.cuobjdump else "sass")
            return real(self, argv, cwd)

        monkeypatch.setattr(Toolchain, "run", counting)
        pipeline.run(COMPILE, pipeline.Work(inputs=(specs,)), ctx)
        monkeypatch.undo()
        return calls

    assert len(build()) == 2 * len(modules)  # cold: nvcc + ptxas for each module
    assert build() == []  # unchanged: every stage is a cache hit
    util = specs / "util.kspec"
    util.write_text(util.read_text().replace("split the joint", "split the fused"))
    # Only attn_util's source changed, so only its nvcc runs; the edit is a comment,
    # the PTX comes out the same and ptxas is a cache hit too.
    assert build() == ["attn_util"]
