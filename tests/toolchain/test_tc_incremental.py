"""Changing one spec recompiles only the kernels it defines; the rest are store hits.
A kernel is its own compile unit: the misses of a module share one nvcc run, and
ptxas runs per kernel."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tc_helpers import covering_specs, repo_context

from kgen.compiler import pipeline
from kgen.ir.axes import Op
from kgen.toolchain.locate import Toolchain

ROOT = Path(__file__).resolve().parents[2]
# The build's stages up to the compiled modules (no outputs written).
COMPILE = ("parse", "context", "check", "render", "ptx", "cubin")


@pytest.mark.toolchain
def test_one_spec_change_recompiles_only_its_kernels(tmp_path, monkeypatch):
    # A copy of every spec; the files that reach every skeleton and format are built
    # (cold, so each is counted), the others are their context.
    specs = tmp_path / "specs"
    shutil.copytree(ROOT / "specs", specs)
    inputs = tuple(specs / Path(p).name for p in covering_specs())
    ctx = repo_context(tmp_path / "cache")
    work = pipeline.run(("parse", "context", "check"), pipeline.Work(inputs=inputs), ctx)
    kernels = work.own_kernels
    modules = {k.module for k in kernels}
    alone = {m for m in modules if sum(k.module == m for k in kernels) == 1}

    def build() -> list[str]:
        calls: list[str] = []
        real = Toolchain.run

        def counting(self, argv, cwd=None):
            calls.append(Path(argv[-1]).stem if argv[0] != self.cuobjdump else "sass")
            return real(self, argv, cwd)

        monkeypatch.setattr(Toolchain, "run", counting)
        pipeline.run(COMPILE, pipeline.Work(inputs=inputs), ctx)
        monkeypatch.undo()
        return calls

    cold = build()
    # cold: one nvcc run per module (a batch, or the kernel alone) and ptxas per kernel
    assert sorted(c for c in cold if c in modules) == sorted(modules - alone)
    assert len(cold) == len(modules) + len(kernels)
    assert build() == []  # unchanged: every stage is a store hit
    util = specs / "util.kspec"
    util.write_text(util.read_text().replace("split the joint", "split the fused"))
    # Only fc_attn_qz_split's source changed, so only its nvcc runs; the edit is a
    # comment, the PTX comes out the same and ptxas is a store hit too.
    assert build() == ["fc_attn_qz_split"]
    # A flash kernel added to the largest module that has one (in its spec file: a
    # module's kernels are defined in one file) compiles that kernel alone.
    flash = [k for k in kernels if k.op is Op.FLASH]
    biggest = max({k.module for k in flash}, key=lambda m: sum(k.module == m for k in kernels))
    parent = next(k for k in flash if k.module == biggest)
    home = Path(parent.spec_path)
    home.write_text(home.read_text(encoding="utf-8") + f"\nkernel zz_one_more : {parent.name} "
                    "{\n    doc = \"one more\"\n    max_groups = 2\n}\n", encoding="utf-8")
    assert build() == ["zz_one_more", "zz_one_more"]  # its nvcc, its ptxas
