"""Compile-time limits: a one-row sink and window ring is a legal (if small) cache, and
its generated tests run the shapes it holds; limits with no legal launch or beyond the
target are spec errors (tests/fixtures/invalid/check_limits_*)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kgen.compiler import pipeline
from kgen.compiler.spec.parser import parse_spec
from kgen.testing import check_mutation, mutations_for
from kgen.testing.testgen import cases, plan_cases

ROOT = Path(__file__).resolve().parents[2]

SPEC = """
kernel t_append_small_rings : fc_attn_kv_append_q4 {
    module = attn_small
    ring_rows = 1
    sink_rows = 1
}
kernel t_prefill_small_rings : fc_attn_flash_prefill_q4 {
    module = attn_small
    ring_rows = 1
    sink_rows = 1
}
"""


@pytest.fixture(scope="module")
def small():
    files = [*pipeline.parse([ROOT / "specs"], ROOT), parse_spec(SPEC, "small.kspec")]
    return [k for k in pipeline.checked(files) if k.module == "attn_small"]


def test_small_rings_are_tested_with_what_they_hold(small):
    for k in small:
        planned = cases(k)
        assert planned
        assert all(c.sink <= 1 and c.win <= 1 for c in planned)
        if k.name.startswith("t_prefill"):
            assert any(c.win == 1 and c.sink == 1 for c in planned)  # shadows exercised
        for m in mutations_for(k):
            check_mutation(k, planned[0], m)


def test_refused_shapes_are_listed(small):
    _, refused = plan_cases(small[0])
    assert refused and all("[contract:" in why for _, why in refused)


@pytest.mark.parametrize("threads, registers, shared, want", [
    # (blocks, warps) per sm_37 multiprocessor, by the rules of the CUDA occupancy
    # calculator for compute 3.7: registers in 256-register units per warp, shared
    # memory in 256-byte units, 2048 threads, 16 blocks, 128K registers, 112 KB.
    (256, 32, 0, (8, 64)),          # threads bound: 2048 / 256
    (64, 32, 0, (16, 32)),          # the 16-block bound
    (256, 62, 26720, (4, 32)),      # shared memory bound: 112 KB / 26880
    (256, 192, 0, (2, 16)),         # registers: 6144 a warp, 8 warps a block
    (128, 255, 0, (4, 16)),         # 8160 -> 8192 a warp
    (1024, 64, 0, (2, 64)),
    (1024, 65, 0, (0, 0)),          # 72 registers a thread: more than 64K to one block
    (256, 32, 48 * 1024 + 1, (0, 0)),  # more shared memory than one block may use
])
def test_sm37_occupancy(threads, registers, shared, want):
    from kgen.ir.target import TARGET

    assert TARGET.occupancy(threads, registers, shared) == want
