"""The quads split decode (lane_dims = quads, prefetch = next_step): its lanes read cache
rows four elements a load through the formats' quad readers (its caches' alignment
contract is tested with the swizzled query tile's, tests/cpu/test_qtile_swizzle.py); it
serves one head_dim and its group bound; and the default decode choice takes it before
the strided hoisted decode of the same shape. Every kernel is one the build made (the
manifest's), every bound derived from the kernel and its format."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kgen.compiler import pipeline
from kgen.compiler.render import render_units
from kgen.ir.axes import Mode, Op
from kgen.ir.geometry import (
    MERGE_BYTES_PER_THREAD,
    block_threads,
    flash_shared_bytes,
    quad_reads,
    stream_head_dim,
    stream_hoisted,
    stream_merge_units,
    stream_quads,
    stream_units,
)
from kgen.ir.target import TARGET
from kgen.runtime.bind import shape_refusal
from kgen.runtime.select import Role, find, generated
from kgen.testing.built import BUILT, needs_build

pytestmark = needs_build
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quads():
    out = [k for k, _ in generated() if k.op is Op.FLASH and stream_quads(k)]
    assert out, "the build has no quads decode"
    return out


@pytest.fixture(scope="module")
def quad_bodies():
    """(name, kernel body, units) of every quads decode, rendered from the specs."""
    kernels = [k for k in pipeline.checked(pipeline.parse([ROOT / "specs"], ROOT))
               if k.op is Op.FLASH and stream_quads(k)]
    assert kernels
    units = {k.name: stream_units(k, stream_head_dim(k)) for k in kernels}
    return [(u.name, u.source[u.source.index(f"__global__ void {u.name}("):], units[u.name])
            for u in render_units(kernels, ROOT / "templates", ROOT)]



def test_quads_read_through_the_quad_reader(quads):
    for k in quads:
        assert quad_reads(k) and stream_hoisted(k) and k.mode is Mode.DECODE, k.name
        assert k.kreg_max_chunk % 4 == 0, k.name


def test_one_head_dim_and_the_group_bound(quads):
    for k in quads:
        hd = stream_head_dim(k)
        assert shape_refusal(k, hd, k.max_groups) is None, k.name
        assert shape_refusal(k, hd + 4 * k.dot_lanes, 1) is not None, k.name
        assert shape_refusal(k, hd, k.max_groups + 1) is not None, k.name


def test_the_default_decode_is_the_quads_form_where_one_serves(quads):
    """For every shape a quads decode serves (its K and V formats, position and head_dim),
    the default choice is a quads decode, the one of the tightest group bound among them."""
    def shape(k):
        return k.kv.value, k.v_kv.value, k.position, stream_head_dim(k)

    pool = generated()
    bounds = {k.max_groups for k in quads}  # each bound, and one past it
    for kv, v_kv, position, hd in sorted({shape(k) for k in quads}, key=str):
        role = Role(Op.FLASH, position, Mode.DECODE, kv, v_kv=v_kv)
        for groups in sorted({1, *bounds, *(b + 1 for b in bounds)}):
            mine = [k for k in quads if shape(k) == (kv, v_kv, position, hd)
                    and shape_refusal(k, hd, groups) is None]
            if not mine:
                continue
            k, _ = find(role, hd, groups, kernels=pool)
            assert stream_quads(k), (kv, v_kv, position, hd, groups, k.name)
            assert k.max_groups == min(m.max_groups for m in mine), (kv, hd, groups, k.name)


def test_the_first_loads_leave_before_q_is_staged_and_a_thread_ends_each_head(quad_bodies):
    """Rendered from the specs, every quads decode issues its first step's K and V loads
    (into the raw arrays kr0 / vr0) before it stages q and waits at the barrier, so the
    two latencies overlap; and each head's max and merged sum at the end is one thread's
    (tid < G), not thread 0's for every head in turn."""
    for name, body, _ in quad_bodies:
        stage = body.index("q_s[(size_t)g * head_dim + tid] =")
        assert body.index("kr0[qd]") < stage and body.index("vr0[qd]") < stage, name
        assert body.index("__syncthreads()") > stage, name
        end = body[body.index("The split's partial"):]
        assert "if (tid < G)" in end and "tid == 0" not in end, name


def test_a_step_branches_on_no_head_and_skips_a_rescale_no_max_needs(quad_bodies):
    """Rendered from the specs, a quads decode's key loop scores and folds every head up
    to its group bound with no branch per head, rescales acc only under a warp vote that
    some head's lagging max moved, and its end stores each unit's true max with the sum
    taken to it (so the partial is the split's max, sum and acc)."""
    for name, body, _ in quad_bodies:
        loop = body[body.index("for (int base = "):body.index("A head's l is the sum")]
        assert "if (g < G)" not in loop, name
        assert loop.count("if (__any_sync(0xffffffffu, moved))") >= 1, name
        assert "mx > m_own[q] + RESCALE_SLACK ? mx : m_own[q]" in loop, name
        assert "m_top[q] = fmaxf(m_top[q], mx);" in loop, name
        merge = body[body.index("Merge the units in unit order"):]
        assert "m_s[unit * G + g] = m_top_run[g];" in merge, name
        assert "l_run[g] * expf(m_run[g] - fmaxf(m_top_run[g]" in merge, name


def test_the_units_merge_in_phases_that_cost_a_k80_no_block(quads):
    """A quads decode merges its units in phases of stream_merge_units units (a power of
    two that divides them) whose buffer takes at most MERGE_BYTES_PER_THREAD bytes a
    thread -- beyond a phase of one unit, which is the serial merge's one-head-set buffer
    itself (the wide-group forms' G x head_dim floats may pass the budget alone); with
    the registers ptxas gave the kernel (the manifest's), that buffer costs it no block on
    an sm_37 SMX against the one-head-set buffer of the serial merge."""
    for k in quads:
        hd, g = stream_head_dim(k), k.max_groups
        units, p, threads = stream_units(k, hd), stream_merge_units(k), block_threads(k, hd)
        assert p >= 1 and p & (p - 1) == 0 and units % p == 0, k.name
        assert p == 1 or p * g * hd * 4 <= threads * MERGE_BYTES_PER_THREAD, k.name
        regs = int(BUILT.kernels[k.name].resources["registers"])
        phased = flash_shared_bytes(k, g, hd)
        serial = phased - (p - 1) * g * hd * 4
        assert (TARGET.occupancy(threads, regs, phased)[0]
                == TARGET.occupancy(threads, regs, serial)[0]), (k.name, regs, phased)


def test_the_merge_stores_weighted_accs_a_phase_and_adds_them_in_unit_order(quad_bodies):
    """Rendered from the specs, a quads decode's merge has one barrier a phase (none a
    unit): a phase's units store w * acc, each thread adds its dim's values unit by unit
    from 0 -- the serial merge's sums in its order -- and the partial's acc is that sum.
    Its unit count is a compile-time constant (one head_dim, one block size), so the
    loops over units unroll."""
    for name, body, units in quad_bodies:
        assert f"constexpr int UNITS = {units};" in body, name
        assert "blockDim.x / DOT_LANES" not in body, name
        merge = body[body.index("The units' accs in phases"):body.index("The split's partial")]
        assert "if (unit == u)" not in merge, name
        assert merge.count("__syncthreads()") == 2, name  # a phase's, and between phases
        assert "= w[g] * acc[g][i];" in merge and "fold[g] += acc_s[" in merge, name
        assert "acc_out[po * head_dim + tid] = fold[g];" in body, name


_SCATTER = re.compile(
    r"const float (rs\d+_\d+) = \(up(\d+) \? ([^:]+) : ([^)]+)\) \+\s*"
    r"__shfl_xor_sync\(0xffffffffu, up\d+ \? ([^:]+) : ([^,]+), (\d+), DOT_LANES\);")


def _scattered(body: str, sc: np.ndarray) -> list[list[float]]:
    """Run a rendered step's reduce-scatter (its first copy) on the lanes: ``sc`` [lane]
    [key b][head g] the lanes' partial dots; each lane's hv[] after it (and the duplicate
    sums)."""
    lanes = sc.shape[0]
    i = body.index("Reduce-scatter the MAX_GROUPS")
    j = body.index("float hv[RS_R];", i)
    env: list[dict] = [{} for _ in range(lanes)]

    def val(expr: str, lane: int) -> float:
        m = re.fullmatch(r"sc\[(\d+)\]\[(\d+)\]", expr.strip())
        if m:
            return float(sc[lane, int(m.group(1)), int(m.group(2))])
        return 0.0 if expr.strip() == "0.0f" else env[lane][expr.strip()]

    stmts = _SCATTER.findall(body[i:j])
    # One value a lane (one head, one key in flight) has nothing to scatter: its sum is
    # the butterfly's alone.
    assert stmts or sc.shape[1] * sc.shape[2] == 1, "no reduce-scatter in the step"
    for name, bit, hi, lo, send_hi, send_lo, off in stmts:
        bit, off = int(bit), int(off)
        got = [val(hi if lane & bit else lo, lane) +
               val(send_hi if (lane ^ off) & bit else send_lo, lane ^ off)
               for lane in range(lanes)]
        for lane in range(lanes):
            env[lane][name] = got[lane]
    tail = body[j:j + 4000]
    r = int(re.search(r"constexpr int RS_R = (\d+);", body).group(1))
    hv = [[val(e, lane) for e in re.findall(r"hv\[\d+\] = ([^;]+);", tail)[:r]]
          for lane in range(lanes)]
    for off in map(int, re.findall(r"hv\[0\] \+= __shfl_xor_sync\(0xffffffffu, hv\[0\], "
                                   r"(\d+), DOT_LANES\)", tail)):
        hv = [[hv[lane][0] + hv[lane ^ off][0], *hv[lane][1:]] for lane in range(lanes)]
    return hv


def test_the_reduce_scatter_leaves_each_lane_the_sums_it_is_read_for(quad_bodies):
    """Rendered from the specs, run on a model of the lanes: every quads decode's
    reduce-scatter leaves lane l the complete sums over its unit of the values n = g *
    RS_BP + b = (l >> RS_S) * RS_R + r, where the softmax reads head g's key b (rs_src,
    rs_q, rs_t) -- for every lane count, group bound and keys in flight the specs
    generate (a lane holding two heads, RS_GL = 2, among them)."""
    rng = np.random.default_rng(0)
    seen = set()
    for name, body, _ in quad_bodies:
        c = {k: int(v) for k, v in re.findall(r"constexpr int (\w+) = (\d+);", body)}
        shape = (c["DOT_LANES"], c["MAX_GROUPS"], c["KEYS_PER_STEP"])
        if shape in seen:
            continue
        seen.add(shape)
        lanes, groups, keys = shape
        sc = rng.standard_normal((lanes, keys, groups))
        hv, total = _scattered(body, sc), sc.sum(axis=0)
        for lane in range(lanes):
            for r in range(c["RS_R"]):
                g, b = divmod((lane >> c["RS_S"]) * c["RS_R"] + r, c["RS_BP"])
                want = total[b, g] if g < groups and b < keys else 0.0
                assert np.isclose(hv[lane][r], want), (name, lane, r)
    assert any(c for c in seen if c[1] > 8), "no wide-group decode rendered"
