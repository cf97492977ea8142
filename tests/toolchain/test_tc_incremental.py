"""Changing one spec recompiles only the module it feeds; the rest are cache hits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kgen import pipeline
from kgen.cache import Cache
from kgen.render import render_modules
from kgen.toolchain import Toolchain, find_toolchain

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.toolchain
def test_one_spec_change_recompiles_only_its_module(tmp_path, monkeypatch):
    specs = tmp_path / "specs"
    shutil.copytree(ROOT / "specs", specs)
    tc = find_toolchain()
    cache = Cache(tmp_path / "cache")

    def build() -> list[str]:
        calls: list[str] = []
        real = Toolchain.run

        def counting(self, argv, cwd=None):
            calls.append(Path(argv[-1]).stem if argv[0] != self.cuobjdump else "sass")
            return real(self, argv, cwd)

        monkeypatch.setattr(Toolchain, "run", counting)
        kernels = pipeline.checked(pipeline.parse([specs]))
        pipeline.compile_modules(render_modules(kernels, ROOT / "templates", ROOT), tc, cache)
        monkeypatch.undo()
        return calls

    assert len(build()) == 2 * 4  # cold: nvcc + ptxas for each of the four modules
    assert build() == []  # unchanged: every stage is a cache hit
    util = specs / "util.kspec"
    util.write_text(util.read_text().replace("split the joint", "split the fused"))
    # Only attn_util's source changed, so only its nvcc runs; the edit is a comment,
    # the PTX comes out the same and ptxas is a cache hit too.
    assert build() == ["attn_util"]
