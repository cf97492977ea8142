"""The quads split decode (lane_dims = quads, prefetch = next_step): its lanes read cache
rows four elements a load through the formats' quad readers (its caches' alignment
contract is tested with the swizzled query tile's, tests/cpu/test_qtile_swizzle.py); it
serves one head_dim and its group bound; and the default decode choice takes it before
the strided hoisted decode of the same shape. Every kernel is one the build made (the
manifest's), every bound derived from the kernel and its format."""

from __future__ import annotations

from pathlib import Path

import pytest

from kgen.compiler import pipeline
from kgen.compiler.render import render_units
from kgen.ir.axes import Mode, Op
from kgen.ir.geometry import quad_reads, stream_head_dim, stream_hoisted, stream_quads
from kgen.runtime.bind import shape_refusal
from kgen.runtime.select import Role, find, generated
from kgen.testing.built import needs_build

pytestmark = needs_build
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quads():
    out = [k for k, _ in generated() if k.op is Op.FLASH and stream_quads(k)]
    assert out, "the build has no quads decode"
    return out


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
    for kv, v_kv, position, hd in sorted({shape(k) for k in quads}, key=str):
        role = Role(Op.FLASH, position, Mode.DECODE, kv, v_kv=v_kv)
        for groups in (1, 4, 8):
            mine = [k for k in quads if shape(k) == (kv, v_kv, position, hd)
                    and shape_refusal(k, hd, groups) is None]
            if not mine:
                continue
            k, _ = find(role, hd, groups, kernels=pool)
            assert stream_quads(k), (kv, v_kv, position, hd, groups, k.name)
            assert k.max_groups == min(m.max_groups for m in mine), (kv, hd, groups, k.name)


def test_the_first_loads_leave_before_q_is_staged_and_a_thread_ends_each_head():
    """Rendered from the specs, every quads decode issues its first step's K and V loads
    (into the raw arrays kr0 / vr0) before it stages q and waits at the barrier, so the
    two latencies overlap; and each head's max and merged sum at the end is one thread's
    (tid < G), not thread 0's for every head in turn."""
    kernels = [k for k in pipeline.checked(pipeline.parse([ROOT / "specs"], ROOT))
               if k.op is Op.FLASH and stream_quads(k)]
    assert kernels
    for u in render_units(kernels, ROOT / "templates", ROOT):
        body = u.source[u.source.index(f"__global__ void {u.name}("):]
        stage = body.index("q_s[(size_t)g * head_dim + tid] =")
        assert body.index("kr0[qd]") < stage and body.index("vr0[qd]") < stage, u.name
        assert body.index("__syncthreads()") > stage, u.name
        end = body[body.index("The split's partial"):]
        assert "if (tid < G)" in end and "tid == 0" not in end, u.name


def test_a_step_branches_on_no_head_and_skips_a_rescale_no_max_needs():
    """Rendered from the specs, a quads decode's key loop scores and folds every head up
    to its group bound with no branch per head, rescales acc only under a warp vote that
    some head's lagging max moved, and its end stores each unit's true max with the sum
    taken to it (so the partial is the split's max, sum and acc)."""
    kernels = [k for k in pipeline.checked(pipeline.parse([ROOT / "specs"], ROOT))
               if k.op is Op.FLASH and stream_quads(k)]
    assert kernels
    for u in render_units(kernels, ROOT / "templates", ROOT):
        body = u.source[u.source.index(f"__global__ void {u.name}("):]
        loop = body[body.index("for (int base = "):body.index("A head's l is the sum")]
        assert "if (g < G)" not in loop, u.name
        assert loop.count("if (__any_sync(0xffffffffu, moved))") >= 1, u.name
        assert "mx > m_own[q] + RESCALE_SLACK ? mx : m_own[q]" in loop, u.name
        assert "m_top[q] = fmaxf(m_top[q], mx);" in loop, u.name
        merge = body[body.index("Merge the units in unit order"):]
        assert "m_s[unit * G + g] = m_top_run[g];" in merge, u.name
        assert "l_run[g] * expf(m_run[g] - fmaxf(m_top_run[g]" in merge, u.name
