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


# -- a block that does not fit the target fails the build (kgen.compiler.coverage) -------

WIDE = ROOT / "tests" / "fixtures" / "launch" / "wide_register_k.kspec"


def _kernel(name: str, *extra: Path):
    files = [*pipeline.parse([ROOT / "specs"], ROOT), *pipeline.parse(list(extra), ROOT)]
    return next(k for k in pipeline.checked(files) if k.name == name)


def _res(registers: int, static_smem: int = 0):
    from kgen.toolchain.resources import Resources

    return Resources(registers, 0, 0, 0, static_smem)


def test_registers_times_threads_at_the_widest_launch_its_axes_size_it_for():
    from kgen.compiler.coverage import block_misfit

    k = _kernel("wide_prefill_kr", WIDE)  # register K up to head_dim 64 * 16 = 1024
    why = block_misfit(k, _res(128))  # what ptxas gives it
    assert why == ("128 registers a thread x 1024 threads at head_dim 1024, kv_groups 8 take "
                   "131072 registers a block (4096 a warp, allocated in units of 256, x 32 "
                   "warps); sm_37 allows 65536 a block")
    # 64 registers (2048 a warp) x 32 warps is the whole register file of a block
    assert block_misfit(k, _res(64)) is None
    assert block_misfit(k, _res(65)) is not None  # 2304 a warp: the unit rounds it up


def test_registers_of_a_kernel_with_no_head_dim_bound_of_its_own_at_its_smallest_launch():
    from kgen.compiler.coverage import block_misfit

    k = _kernel("fc_attn_flash_prefill")  # 256 threads at its smallest head_dim
    assert block_misfit(k, _res(255)) is None  # 8 warps x 8192 = 65536
    k = _kernel("qt_f32_causal_v4_r64k32_m2x4")  # a query_tile block: 256 threads, fixed
    assert k.tile_rows // k.micro_rows * (k.tile_keys // k.micro_keys) == 256
    assert block_misfit(k, _res(255)) is None


def test_static_shared_memory_on_top_of_the_widest_launch():
    from kgen.compiler.coverage import block_misfit

    k = _kernel("fc_attn_kv_append_q4")  # ptxas: 8192 bytes of static staging
    assert block_misfit(k, _res(26, 8192)) is None
    why = block_misfit(k, _res(26, 48 * 1024 + 4))
    assert why == ("49156 bytes of shared memory a block at head_dim 32 (49156 static, 0 "
                   "dynamic); sm_37 allows 49152 a block")
    k = _kernel("fc_attn_flash_prefill")  # its widest launch's dynamic memory, plus static
    why = block_misfit(k, _res(56, 1024))
    assert why == ("50132 bytes of shared memory a block at head_dim 512, kv_groups 7 (1024 "
                   "static, 49108 dynamic); sm_37 allows 49152 a block")


def test_the_listing_gives_a_combine_its_sm37_occupancy_from_its_own_geometry():
    """`kgen list --json --resources`: a decode combine's occupancy is its block's (a
    staged one COMBINE_THREADS threads and its static stage at any head_dim, a serial one
    head_dim threads), not left out as it was for every op but flash."""
    from kgen.compiler.coverage import OCCUPANCY_HEAD_DIMS, limits
    from kgen.ir.axes import Op
    from kgen.ir.geometry import COMBINE_THREADS, combine_staged
    from kgen.ir.target import TARGET

    files = pipeline.parse([ROOT / "specs"], ROOT)
    combines = [k for k in pipeline.checked(files) if k.op is Op.DECODE_COMBINE]
    assert any(combine_staged(k) for k in combines) and not all(map(combine_staged, combines))
    for k in combines:
        res = {"registers": 69, "stack_frame": 0, "spill_stores": 0, "static_smem": 17424}
        occ = limits(k, res)["sm_37"]["occupancy"]
        assert sorted(occ, key=int) == [str(d) for d in OCCUPANCY_HEAD_DIMS]
        for hd, row in occ.items():
            threads = COMBINE_THREADS if combine_staged(k) else int(hd)
            blocks, warps = TARGET.occupancy(threads, 69, 17424)
            assert row == {"threads": threads, "shared_bytes": 17424,
                           "blocks_per_sm": blocks, "warps_per_sm": warps}
            assert blocks >= 1


def test_occupancy_at_a_launchs_groups_uses_that_launchs_shared_memory():
    """coverage.occupancy with ``groups`` (the benchmark's K80 column): the launch's own
    group count sizes the block's shared memory, where the listing takes the most the
    kernel allows; with as many groups as that, the two agree."""
    from kgen.compiler.coverage import groups_by_head_dim, occupancy
    from kgen.ir.geometry import flash_shared_bytes

    k = _kernel("dq_q8_0_d128_g4_host")
    res = {"registers": 132, "static_smem": 0}
    most = groups_by_head_dim(k, [128])[128]
    listed = occupancy(k, res, [128])["128"]
    assert occupancy(k, res, [128], most)["128"] == listed
    one = occupancy(k, res, [128], 1)["128"]
    assert one["shared_bytes"] == flash_shared_bytes(k, 1, 128) <= listed["shared_bytes"]
    assert one["blocks_per_sm"] >= listed["blocks_per_sm"] >= 1
    tile = _kernel("qs_f16_causal")                     # serves head_dim 4 to 128
    assert list(occupancy(tile, res, [96, 128], 2)) == ["96", "128"]  # every dim asked


def test_the_listing_gives_occupancy_at_the_widest_head_size_a_kernel_serves(tmp_path):
    """`kgen list --json --resources`: a kernel written for a head size off the listed
    ones (here a query tile sized for 192, which serves 4..192) shows its occupancy at
    that size as well as at the listed sizes it serves; one whose widest size is listed
    shows just those, one serving past the largest listed size stops there, and a
    hoisted decode that serves one size shows that one."""
    from kgen.compiler.coverage import OCCUPANCY_HEAD_DIMS, head_dims, limits, occupancy

    spec = tmp_path / "wide.kspec"
    spec.write_text(
        "kernel probe_qs_f16_d192 : qsw_base {\n"
        '    doc = "a query tile for head_dim 192"\n'
        "    module = attn_probe\n"
        "    kv = f16\n"
        "    max_head_dim = 192\n"
        "    tile_rows = 32\n"
        "    tile_keys = 16\n"
        "    micro_rows = 2\n"
        "    micro_keys = 2\n"
        "}\n")
    res = {"registers": 128, "stack_frame": 0, "spill_stores": 0, "static_smem": 0}
    expected = {
        "probe_qs_f16_d192": ["64", "128", "192"],
        "qs_f16_causal": ["64", "128"],           # serves 4..128: its widest is listed
        "dq_f16_d96_g4_host": ["96"],             # one size
        "fc_attn_flash_decode": ["256", "512"],  # serves 256..704 here: past 512
    }
    wide = _kernel("fc_attn_flash_decode")  # past 512 only: its smallest stands in
    assert list(occupancy(wide, res, [576, 640])) == ["576"]
    for name, want in expected.items():
        k = _kernel(name, spec)
        dims = head_dims(k)
        occ = limits(k, res)["sm_37"]["occupancy"]
        assert list(occ) == want, (name, dims[0], dims[-1])
        assert set(want) >= {str(d) for d in OCCUPANCY_HEAD_DIMS if d in dims}
        for d in want:
            assert occ[d] == occupancy(k, res, [int(d)], None)[d]
