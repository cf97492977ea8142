"""Mixed K/V formats on the CPU: a pair of one format answers every question as that
format does (so every cache of one format, and every kernel, is what it was); a mixed
pair takes each role's facts from its own format; the host model writes and reads each
role in its format; the spec axis v_kv defaults to kv; and the cache objects, over the
fake CuPy, choose the mixed kernels for a mixed cache (and never for a cache of one
format), lay out each role's rows in its format, and refuse a pair they cannot serve
before touching the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.formats import FORMATS, KvPair, as_pair, pair
from kgen.ir.axes import Op
from kgen.numpy_ref.paged import dense as gather
from kgen.ops import params
from kgen.runtime import ContractError, tuned
from kgen.runtime.kv import KVCache
from kgen.runtime.paged import PagedKVCache
from kgen.runtime.select import generated
from kgen.testing import rng
from kgen.testing.built import needs_build
from kgen.testing.fakecupy import Guarded

HK, H, HD = 2, 8, 128


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_pair_of_one_format_answers_as_the_format(name):
    fmt = FORMATS[name]
    p = as_pair(name)
    assert p == pair(name) == KvPair(fmt, fmt) and not p.mixed and p.name == name
    assert p.shadow_buffers() == fmt.shadow_buffers()
    assert p.shadow_scalars() == fmt.shadow_scalars()
    assert p.scale_scalars() == fmt.scale_scalars()
    assert (p.shadows, p.tensor_scales, p.append_wraps, p.append_staging, p.block, p.fp16) \
        == (fmt.shadows, fmt.tensor_scales, fmt.append_wraps, fmt.append_staging,
            fmt.block, fmt.fp16)
    for hd in (8, 32, 40, 96, 128):
        assert p.accepts_head_dim(hd) == fmt.accepts_head_dim(hd)


def test_a_mixed_pair_takes_each_role_from_its_format():
    p = pair("q8_0", "q4")
    assert p.mixed and p.name == "q8_0/q4" and p.of("k") is FORMATS["q8_0"]
    assert [s.name for s in p.shadow_buffers()] == ["v_sink", "v_win"]  # V's only
    assert p.shadow_scalars() == ("sink", "win") and not p.append_wraps
    assert p.position_bytes(128) == FORMATS["q8_0"].row_bytes(128) + FORMATS["q4"].row_bytes(128)
    f = pair("fp8_e4m3", "f16")
    assert f.scale_scalars() == ("k_scale",) and not f.shadows and f.append_wraps
    assert pair("f16", "q8_0").block == 32 and not pair("f16", "q8_0").accepts_head_dim(40)


def test_the_host_model_writes_and_reads_each_role_in_its_format():
    """K rows quantized as q8_0, V rows as q4 with V's fp16 shadows; reading back gives
    each role's dequantized rows, V's sink and window keys from its shadows."""
    g, seed = rng()
    p = pair("q8_0", "q4")
    c = ref.HostCache.empty(p, HK, 64, HD, ring_rows=16, sink_rows=4)
    assert c.k.shape == (HK, 64, FORMATS["q8_0"].row_width(HD))
    assert c.v.shape == (HK, 64, FORMATS["q4"].row_width(HD))
    assert list(c.shadows) == ["v_sink", "v_win"] and c.pair == p
    assert (c.ring_rows, c.sink_rows, c.head_dim) == (16, 4, HD)
    n = 40
    kx = g.standard_normal((n, HK, HD)).astype(np.float32)
    vx = g.standard_normal((n, HK, HD)).astype(np.float32)
    ref.append(kx, vx, c, 0, sink=4, win=8)
    kr, vr = ref.read_kv_rows(c, n - 1, sink=4, win=8)
    want_k = np.swapaxes(FORMATS["q8_0"].dequantize_rows(FORMATS["q8_0"].quantize_rows(kx)),
                         0, 1)
    np.testing.assert_array_equal(kr, want_k, err_msg=f"seed={seed}")
    body = np.swapaxes(FORMATS["q4"].dequantize_rows(FORMATS["q4"].quantize_rows(vx)), 0, 1)
    half = np.swapaxes(vx.astype(np.float16).astype(np.float32), 0, 1)
    src = ref.shadow_source(np.arange(n), n - 1, 4, 8)
    want_v = np.where((src == ref.SRC_BODY)[None, :, None], body, half)
    np.testing.assert_array_equal(vr, want_v, err_msg=f"seed={seed}")
    assert (src != ref.SRC_BODY).any() and (src == ref.SRC_BODY).any()


def test_the_paged_host_model_keeps_each_role_in_its_format():
    g, seed = rng()
    pages = ref.PagedCache.empty(pair("f16", "q8_0"), 4, 16, HK, HD)
    assert pages.k.dtype == np.float16 and pages.v.dtype == np.uint8
    kx = g.standard_normal((5, HK, HD)).astype(np.float32)
    vx = g.standard_normal((5, HK, HD)).astype(np.float32)
    pages.store(kx, vx, np.arange(5))
    dense = gather(pages, np.array([0]), 5)
    kr, vr = ref.read_kv_rows(dense, 4)
    np.testing.assert_array_equal(kr, np.swapaxes(kx.astype(np.float16), 0, 1)
                                  .astype(np.float32), err_msg=f"seed={seed}")
    want_v = FORMATS["q8_0"].dequantize_rows(FORMATS["q8_0"].quantize_rows(vx))
    np.testing.assert_array_equal(vr, np.swapaxes(want_v, 0, 1), err_msg=f"seed={seed}")


# ---- the built kernels ----------------------------------------------------------------

@needs_build
def test_v_kv_defaults_to_kv_and_mixed_kernels_read_v_through_its_format():
    ks = [k for k, _ in generated()]
    assert all(k.v_kv == k.kv for k in ks if not k.mixed)
    mixed = [k for k in ks if k.mixed]
    assert mixed, "specs/mixed.kspec builds mixed kernels"
    for k in mixed:
        assert k.op in (Op.FLASH, Op.KV_APPEND)
        dtypes = {p.name: p.dtype for p in params(k) if p.name in ("k_cache", "v_cache")}
        assert dtypes == {"k_cache": k.fmt.dtype, "v_cache": k.v_fmt.dtype}
        shadows = [p.name for p in params(k) if p.ctype.endswith("__half *")
                   and not p.name.endswith("_cache")]
        assert shadows == [s.name for s in k.pair.shadow_buffers()]


@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(tuned, "tuned", lambda *a: None)
    monkeypatch.setattr(tuned, "tuned_prefill", lambda *a: None)
    return Guarded().install(monkeypatch)


def _pairs(position: str) -> list[tuple[str, str]]:
    """The mixed pairs a cache can hold at ``position``: those with an append there (a
    build may carry a pair's decode alone; a cache of it is refused, no kernel serving)."""
    return sorted({(k.kv.value, k.v_kv.value) for k, _ in generated()
                   if k.mixed and k.op is Op.KV_APPEND and k.position.value == position})


def _launched(cp) -> list[str]:
    return [name for name, *_ in cp.launched]


@needs_build
@pytest.mark.parametrize("kv, v_kv", _pairs("host"))
def test_a_mixed_cache_runs_its_pair_kernels(cp, kv, v_kv):
    """Its arrays hold each role's rows in its format (the shadows of the roles that
    keep them), and every kernel of a prefill and a decode is of its pair."""
    p = pair(kv, v_kv)
    shadows = {"sink": 4, "win": 32} if p.shadows else {}
    c = KVCache(HK, HD, 256, kv=kv, v_kv=v_kv, **shadows)
    assert (c.pair, c.fmt, c.v_kv) == (p, p.k, v_kv)
    assert c.k.dtype == p.k.dtype and c.k.shape == (HK, 256, p.k.row_width(HD))
    assert c.v.dtype == p.v.dtype and c.v.shape == (HK, 256, p.v.row_width(HD))
    assert len(c.shadows) == len(p.shadow_buffers())
    for n in (8, 200):  # a few rows, and rows that fill 8 query tiles
        cp.launched.clear()
        c.prefill(cp.empty((n, H, HD)), cp.empty((n, HK, HD)), cp.empty((n, HK, HD)),
                  pos0=c.length)
        names = _launched(cp)
        assert names and (c.last_prefill_split or c.last_prefill) in names
        by = {k.name: k for k, _ in generated()}
        cache_ops = [x for x in names if by[x].op in (Op.FLASH, Op.KV_APPEND)]
        # (a split prefill's combine reads f32 partials: no cache format)
        assert all((by[x].kv.value, by[x].v_kv.value) == (kv, v_kv) for x in cache_ops), names
        # any batch takes the query tile (MIN_QUERY_TILES = 0; a pair with fp16 shadows,
        # q8_0 / q4, its two-pass form of specs/qtile_shadows.kspec)
        assert by[c.last_prefill].schedule.value == "query_tile", c.last_prefill
    cp.launched.clear()
    c.decode(cp.empty((H, HD)), cp.empty((1, HK, HD)), cp.empty((1, HK, HD)), pos=c.length)
    by = {k.name: k for k, _ in generated()}
    cache_ops = [x for x in _launched(cp) if by[x].op in (Op.FLASH, Op.KV_APPEND)]
    assert cache_ops and all(by[x].mixed for x in cache_ops), _launched(cp)
    flash = [by[x] for x in cache_ops if by[x].op is Op.FLASH]
    assert flash and all(k.stream_loads.value == "hoisted" for k in flash), cache_ops


@needs_build
@pytest.mark.parametrize("kv", ["q8_0", "f16", "q4"])
def test_a_cache_of_one_format_never_runs_a_mixed_kernel(cp, kv):
    shadows = {"sink": 4, "win": 32} if FORMATS[kv].shadows else {}
    c = KVCache(HK, HD, 256, kv=kv, **shadows)
    c.prefill(cp.empty((8, H, HD)), cp.empty((8, HK, HD)), cp.empty((8, HK, HD)), pos0=0)
    c.decode(cp.empty((H, HD)), cp.empty((1, HK, HD)), cp.empty((1, HK, HD)), pos=8)
    by = {k.name: k for k, _ in generated()}
    assert not any(by[x].mixed for x in _launched(cp)), _launched(cp)


@needs_build
@pytest.mark.parametrize("kv, v_kv", _pairs("paged"))
def test_a_mixed_paged_cache_runs_its_pair_kernels(cp, kv, v_kv):
    c = PagedKVCache(16, 16, HK, HD, kv=kv, v_kv=v_kv)
    p = pair(kv, v_kv)
    assert c.k.dtype == p.k.dtype and c.k.shape == (16, 16, HK, p.k.row_width(HD))
    assert c.v.dtype == p.v.dtype and c.v.shape == (16, 16, HK, p.v.row_width(HD))
    a, b = c.add(), c.add()
    c.prefill([a, b], cp.empty((12, H, HD)), cp.empty((12, HK, HD)), cp.empty((12, HK, HD)),
              [7, 5])
    c.decode([a, b], cp.empty((2, H, HD)), cp.empty((2, HK, HD)), cp.empty((2, HK, HD)))
    by = {k.name: k for k, _ in generated()}
    cache_ops = [x for x in _launched(cp) if by[x].op in (Op.FLASH, Op.KV_APPEND)]
    assert cache_ops and all(by[x].mixed for x in cache_ops), _launched(cp)


@needs_build
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("kv, v_kv", _pairs("paged"))
def test_a_pageable_pair_prefills_through_the_swizzled_tile_dense_and_paged_alike(cp, kv, v_kv,
                                                                                   hd):
    """A pair without shadows takes the swizzled query tile, as its formats alone do, at
    the tightest head bound that serves its head_dim, with the same tile dense and over
    pages (so one sequence gets the dense bits); the pair has no split form, so a chunk
    after a context runs whole in both."""
    by = {k.name: k for k, _ in generated()}
    swizzled = [k for k in by.values() if k.mixed and k.qtile_loads.value == "swizzle"
                and (k.kv.value, k.v_kv.value) == (kv, v_kv)]
    bound = min(k.max_head_dim for k in swizzled if k.max_head_dim >= hd)
    d = KVCache(HK, hd, 4096, kv=kv, v_kv=v_kv)
    d.prefill(cp.empty((8, H, hd)), cp.empty((8, HK, hd)), cp.empty((8, HK, hd)), pos0=2048)
    p = PagedKVCache(512, 16, HK, hd, kv=kv, v_kv=v_kv)
    a = p.add()
    p.prefill([a], cp.empty((8, H, hd)), cp.empty((8, HK, hd)), cp.empty((8, HK, hd)), [8])
    kd, kp = by[d.last_prefill], by[p.last_prefill]
    assert kd.mixed and kp.mixed and kd.qtile_loads.value == "swizzle", d.last_prefill
    assert kd.max_head_dim == bound, (hd, d.last_prefill)
    tile = ("tile_rows", "tile_keys", "micro_rows", "micro_keys", "max_head_dim", "qk_split")
    assert [getattr(kd, t) for t in tile] == [getattr(kp, t) for t in tile]
    assert (d.last_prefill_splits, p.last_prefill_splits) == (1, 1)


@needs_build
def test_a_pair_nobody_serves_is_refused_before_any_allocation(cp):
    """No paged kernel keeps q4's per-sequence shadows; no kernel pairs f32 with bf16;
    a scale for a role whose format has none; an unknown V format."""
    cp.armed, cp.touched = True, []
    for make, match in (
            (lambda: PagedKVCache(16, 16, HK, HD, kv="q8_0", v_kv="q4"), "no generated kernel"),
            (lambda: KVCache(HK, HD, 64, kv="f32", v_kv="bf16"), "no generated kernel"),
            (lambda: KVCache(HK, HD, 64, kv="q8_0", v_kv="f16", k_scale=2.0), "scales"),
            (lambda: KVCache(HK, HD, 64, kv="q8_0", v_kv="q5"), "v_kv must be one of")):
        with pytest.raises(ContractError, match=match):
            make()
    assert cp.touched == []
