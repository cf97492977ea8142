"""The quads split decode (lane_dims = quads, prefetch = next_step): its lanes read cache
rows four elements a load through the formats' quad readers (its caches' alignment
contract is tested with the swizzled query tile's, tests/cpu/test_qtile_swizzle.py); it
serves one head_dim and its group bound; and the default decode choice takes it before
the strided hoisted decode of the same shape. Every kernel is one the build made (the
manifest's), every bound derived from the kernel and its format."""

from __future__ import annotations

import pytest

from kgen.ir.axes import Mode, Op
from kgen.ir.geometry import quad_reads, stream_head_dim, stream_hoisted, stream_quads
from kgen.runtime.bind import shape_refusal
from kgen.runtime.select import Role, find, generated
from kgen.testing.built import needs_build

pytestmark = needs_build


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
