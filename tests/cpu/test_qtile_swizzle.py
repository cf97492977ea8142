"""The swizzled query tile's host contracts (qtile_loads = swizzle): its cache rows are
read four elements a load (the format's load_key_quad), so a K or V cache array must start
on the format's quad boundary (KvFormat.quad_bytes; the quads decode's too) and head_dim
be whole float4s; the geometry sizes its shared rows to the kernel's bound, not the
launch's head_dim; and the default prefill choice takes it before the scalar query tile.
Every kernel is one the build made (the manifest's), every bound derived from the format
and the kernel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kgen.compiler import pipeline
from kgen.compiler.render import render_units
from kgen.ir.axes import Mode, Op, Position, Prefetch
from kgen.ir.geometry import (
    flash_shared_bytes,
    head_dim_step,
    qtile_swizzle,
    qtile_threads,
    quad_reads,
    row_lanes,
    swizzle_stride,
)
from kgen.ir.target import TARGET
from kgen.runtime import ContractError, bind
from kgen.runtime.bind import shape_refusal
from kgen.runtime.select import Role, find, generated
from kgen.testing import Case, host_args
from kgen.testing.built import needs_build
from kgen.testing.fakecupy import FakeArray, _Ptr
from kgen.testing.testgen import cases

pytestmark = needs_build


def _built(keep) -> list:
    """The built kernels (the manifest's) that ``keep`` accepts."""
    return [k for k, _ in generated() if k.op is Op.FLASH and keep(k)]


@pytest.fixture(scope="module")
def swizzled():
    out = _built(qtile_swizzle)
    assert out, "the build has no swizzled query tile"
    return out


def _case(k) -> Case:
    hd = k.max_head_dim
    if k.position is Position.PAGED:
        return Case("paged", head_dim=hd, n_head=4, n_head_kv=2, requests=((5, 9), (3, 3)),
                    block_size=4)
    return Case("host", head_dim=hd, n=5, n_head=4, n_head_kv=2, max_seq=16, pos0=2)


def _shifted(x: np.ndarray, by: int) -> FakeArray:
    """``x``'s shape and dtype at a device address ``by`` bytes off a 256-byte boundary."""
    return FakeArray(x.shape, x.dtype, data=_Ptr(0, 0x10000 + by))


def _placed(a: dict, side: str, by: int) -> dict:
    """The argument set with its ``side`` cache (k_cache, v_cache) at an address ``by``
    bytes off."""
    return {**a, side: _shifted(a[side], by)}


@pytest.fixture(scope="module")
def quad_readers():
    """Every built kernel that reads cache rows a quad a load: the swizzled query tiles
    and the quads decodes (kgen.ir.geometry.quad_reads)."""
    out = _built(quad_reads)
    assert any(qtile_swizzle(k) for k in out) and not all(qtile_swizzle(k) for k in out)
    return out


def test_a_cache_off_its_quad_boundary_is_refused(quad_readers):
    """Each side's cache on its own format's quad boundary (a mixed pair's K and V
    formats may differ)."""
    for k in quad_readers:
        a = host_args(k, _case(k) if qtile_swizzle(k) else cases(k)[0])
        bind(k, a)  # on the boundary: accepted
        for side, fmt in (("k_cache", k.fmt), ("v_cache", k.v_fmt)):
            quad = fmt.quad_bytes
            bind(k, _placed(a, side, quad))
            if quad == 1:
                continue  # byte reads: any address
            for by in (quad // 2, quad + quad // 2):
                with pytest.raises(ContractError) as e:
                    bind(k, _placed(a, side, by))
                assert e.value.contract == "alignment", k.name
                assert f"{side} must start on a {quad}-byte boundary" in str(e.value), k.name


def test_quad_bytes_are_four_plain_elements_or_the_blocks_alignment(swizzled):
    for fmt in {k.fmt.name: k.fmt for k in swizzled}.values():
        if fmt.block > 1:  # every block starts on block_align bytes: whole blocks of it
            want = fmt.block_align
            assert (fmt.block_width * np.dtype(fmt.dtype).itemsize) % want == 0, fmt.name
        else:
            want = 4 * np.dtype(fmt.dtype).itemsize
        assert fmt.quad_bytes == want, fmt.name


def test_head_dim_is_whole_float4s_up_to_the_bound(swizzled):
    for k in swizzled:
        step = head_dim_step(k)
        assert step % 4 == 0 and step % k.fmt.block == 0, k.name
        assert shape_refusal(k, k.max_head_dim, 1) is None, k.name
        assert shape_refusal(k, step, 1) is None, k.name
        assert "head_dim range" in shape_refusal(k, k.max_head_dim + step, 1), k.name
        if step > 1:
            assert "row format" in shape_refusal(k, step + 1, 1), k.name


def test_shared_rows_are_sized_to_the_bound_and_fit_the_target(swizzled):
    for k in swizzled:
        stride = swizzle_stride(k)
        assert stride >= k.max_head_dim and stride % 32 == 0, k.name
        assert (stride // 4) % row_lanes(k) == 0, k.name  # a row's lanes' quads
        want = 4 * (k.tile_rows + k.tile_keys) * stride
        for hd in (head_dim_step(k), k.max_head_dim):
            assert flash_shared_bytes(k, 1, hd) == want, k.name
        assert want <= TARGET.shared_per_block, k.name


def test_a_tile_takes_every_group_count_to_its_bound_at_the_same_shared_bytes(swizzled):
    """Rows pack (query, q head) pairs, so kv_groups sizes no array of a query tile: one
    serves every group count up to its bound (past the decode's 8, for models with 16 or
    32 q heads a kv head) in the same block, and refuses one past it."""
    for k in swizzled:
        hd = k.max_head_dim
        assert flash_shared_bytes(k, k.max_groups, hd) == flash_shared_bytes(k, 1, hd), k.name
        assert shape_refusal(k, hd, k.max_groups) is None, k.name
        assert "kv_groups" in shape_refusal(k, hd, k.max_groups + 1), k.name


def test_the_default_prefill_is_the_swizzled_tile_where_one_serves(swizzled):
    pool = generated()
    for k in swizzled:
        if k.mode is not Mode.PREFILL or k.window.value != "sink_recent" or \
                k.sinks.value != "none" or k.softcap.value != "none":
            continue
        role = Role(Op.FLASH, k.position, Mode.PREFILL, k.kv.value,
                    needs=(("mask", k.mask.value),))
        # At its bound no swizzled kernel has a tighter one, and no other form ranks first.
        hd = k.max_head_dim
        got, _ = find(role, hd, 4, kernels=pool, rows=4096)
        assert qtile_swizzle(got) and got.max_head_dim == k.max_head_dim, (k.name, got.name)
        # A batch of one row takes it too (MIN_QUERY_TILES = 0: the split form fills the
        # device where its tiles are few).
        few, _ = find(role, hd, 4, kernels=pool, rows=1)
        assert few == got, (k.name, few.name)


def test_a_tile_loads_ahead_where_its_spec_says_and_pages_map_by_a_multiply():
    """Rendered from the specs: a swizzled query tile stages q a float4 at a time with
    its loads in flight before their stores; with prefetch = next_step a V tile's loads
    are issued before the S patch and the next K tile's before P.V (none: each tile's
    loads just before their stores); a paged one maps every key with block_size's
    divider, never a division per key."""
    root = Path(__file__).resolve().parents[2]
    kernels = [k for k in pipeline.checked(pipeline.parse([root / "specs"], root))
               if k.op is Op.FLASH and qtile_swizzle(k)]
    assert any(k.prefetch is Prefetch.NEXT_STEP for k in kernels)
    assert any(k.prefetch is Prefetch.NONE for k in kernels)
    for u, k in zip(render_units(kernels, root / "templates", root), kernels, strict=True):
        body = u.source[u.source.index(f" {u.name}(", u.source.index("__global__ void")):]
        stage = body[body.index("Stage the q tile"):body.index("The thread's rows")]
        assert "__ldg(reinterpret_cast<const float4 *>(src))" in stage, u.name
        loop = body[body.index("for (int j0 = j_lo;"):]
        s_patch, pv = loop.index("/* S patch"), loop.index("O += P.V")
        v_load, v_store = loop.index("v_raw[s] = {};"), loop.index("kv_s4[idx] = st;")
        if k.prefetch is Prefetch.NEXT_STEP:
            assert v_load < s_patch < v_store, u.name
            assert v_store < loop.index("if (k_raw_j0 < j_hi)") < pv, u.name
        else:
            assert s_patch < v_load < v_store < pv and "k_raw_j0" not in body, u.name
        if k.position is Position.PAGED:
            assert "kgen_make_divider(block_size)" in body, u.name
            assert "kgen_page_pos(" not in body and "kgen_page_pos_by(" in loop, u.name


def test_a_split_s_tile_meets_in_the_k_tiles_place_after_every_warp_is_done_with_it():
    """Rendered from the specs: where qk_split > 1, each warp sums its share of the dims;
    a barrier (every warp done with K) comes before the first share is stored in K's
    place, another before a thread sums its patch's shares, and a third before V replaces
    them; and the kernels a spec declares bit-exact with each other split alike."""
    root = Path(__file__).resolve().parents[2]
    kernels = [k for k in pipeline.checked(pipeline.parse([root / "specs"], root))
               if k.op is Op.FLASH and qtile_swizzle(k)]
    split = [k for k in kernels if k.qk_split > 1]
    assert split and any(k.qk_split == 1 for k in kernels)
    by_name = {k.name: k for k in kernels}
    for k in kernels:
        for r in k.relations:
            if r.kind == "bit_exact" and r.other in by_name:
                assert by_name[r.other].qk_split == k.qk_split, (k.name, r.other)
    for u in render_units(split, root / "templates", root):
        loop = u.source[u.source.index("for (int j0 = j_lo;"):]
        shares = loop[loop.index("S patch by shares"):loop.index("Online softmax")]
        first_store = shares.index("qk_own[")
        barriers = [i for i in range(len(shares)) if shares.startswith("__syncthreads()", i)]
        assert len(barriers) == 2, u.name
        assert barriers[0] < first_store < barriers[1] < shares.index("sc[i][j] = s;"), u.name
        after = loop[loop.index("Online softmax"):]
        assert after.index("__syncthreads()") < after.index("kv_s4[idx] = st;"), u.name


def test_a_kernel_names_launch_bounds_exactly_where_its_spec_sets_min_blocks():
    """Rendered from the specs: a query tile with min_blocks > 0 is declared
    ``__launch_bounds__(its threads, min_blocks)`` (a register bound for every target
    its PTX is compiled for); every other kernel carries none."""
    root = Path(__file__).resolve().parents[2]
    kernels = [k for k in pipeline.checked(pipeline.parse([root / "specs"], root))
               if k.op is Op.FLASH and qtile_swizzle(k)]
    assert any(k.min_blocks for k in kernels) and any(not k.min_blocks for k in kernels)
    for u, k in zip(render_units(kernels, root / "templates", root), kernels, strict=True):
        bound = f"__global__ void __launch_bounds__({qtile_threads(k)}, {k.min_blocks}) {u.name}("
        if k.min_blocks:
            assert bound in u.source, u.name
        else:
            assert f"__global__ void {u.name}(" in u.source, u.name
            assert "__launch_bounds__" not in u.source, u.name
