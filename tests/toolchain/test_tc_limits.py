"""A kernel whose block does not fit the target fails its build, from ptxas's report
(registers x threads, shared memory, threads against sm_37's per-block limits): it
would build and then fail its launches (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)."""

from __future__ import annotations

import re
import shutil

import pytest
from tc_helpers import REPO

WIDE = REPO / "tests" / "fixtures" / "launch" / "wide_register_k.kspec"


@pytest.mark.toolchain
def test_a_kernel_whose_block_does_not_fit_fails_the_build_and_writes_nothing(ws):
    before = ws.tree("generated")
    spec = ws.specs / WIDE.name
    shutil.copy2(WIDE, spec)
    r = ws.kgen("build", str(spec))
    assert r.rc == 2, r.text
    assert "Traceback" not in r.text
    line = next(i for i, ln in enumerate(WIDE.read_text().split("\n"), 1)
                if ln.startswith("kernel "))
    head, src, caret = r.err.rstrip("\n").split("\n")[-3:]
    said = re.fullmatch(
        rf"specs/{WIDE.name}:{line}:8: error: wide_prefill_kr cannot launch on sm_37: "
        r"(\d+) registers a thread x 1024 threads at head_dim 1024, kv_groups \d+ take "
        r"(\d+) registers a block \((\d+) a warp, allocated in units of 256, x 32 warps\); "
        r"sm_37 allows 65536 a block", head)
    assert said, head
    regs, block, warp = map(int, said.groups())
    assert warp == -(-regs * 32 // 256) * 256 and block == 32 * warp > 65536
    assert src.strip().startswith("kernel wide_prefill_kr") and caret.strip() == "^"
    assert ws.tree("generated") == before  # the failed build left the tree as it was
    # Sized for head_dim 512 (16 warps), the same kernel fits and builds.
    spec.write_text(spec.read_text().replace("kreg_max_chunk = 64", "kreg_max_chunk = 32"))
    r = ws.kgen("build", str(spec))
    assert r.rc == 0, r.text
    assert "kernels/wide_prefill_kr.fatbin" in ws.tree("generated")
