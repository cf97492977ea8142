"""Mixed K/V caches on a GPU (K rows in one format, V rows in another: specs/mixed.kspec):
a chunked prefill then decode steps through KVCache at head_dim 64, 128 and 256, against
the float64 reference over the rows the kernels read (each role through its own
format's model, V's shadows where its format keeps them), through the schedules a cache
chooses by default. The paged pairs run every test of tests/gpu/test_paged.py (varlen
prefill and decode against float64, the CUDA-graph replay, paged bit for bit the dense
on one sequence), which spans every pageable format and pair."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.formats import pair
from kgen.runtime.select import generated
from kgen.testing import rng

pytestmark = pytest.mark.gpu
RTOL, ATOL = 2e-4, 2e-5
HD, HK, H = 128, 2, 8  # a head size every mixed kernel serves; 4 q heads per kv head


def _pairs(position: str) -> list[tuple[str, str]]:
    return sorted({(k.kv.value, k.v_kv.value) for k, _ in generated()
                   if k.mixed and k.position.value == position})


def _rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("n", [24, 300], ids=["few_rows", "query_tiles"])
@pytest.mark.parametrize("kv, v_kv", _pairs("host"))
def test_mixed_cache_prefill_then_decode(kv, v_kv, n, hd):
    """Chunked prefill (a window ring of V shadows is never lapped), then decode steps at
    a given plan and the default one, every element against float64."""
    import cupy as cp

    from kgen.runtime.kv import KVCache

    g, seed = rng()
    sink, win = (4, 96) if pair(kv, v_kv).shadows else (0, 0)
    cache = KVCache(HK, hd, 512, kv=kv, v_kv=v_kv, sink=sink, win=win)
    host = ref.HostCache.empty(cache.pair, HK, cache.max_seq, hd, cache.RING_ROWS,
                               cache.SINK_ROWS)
    scale, G = 1 / math.sqrt(hd), H // HK
    q, kn, vn = _rand(g, n, H, hd), _rand(g, n, HK, hd), _rand(g, n, HK, hd)
    got = cache.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0).get()
    kp = next(k for k, _ in generated() if k.name == cache.last_prefill)
    assert kp.mixed and (kp.kv.value, kp.v_kv.value) == (kv, v_kv), kp.name
    # any batch takes the query tile (MIN_QUERY_TILES = 0; a pair with fp16 shadows, q8_0
    # / q4, its two-pass form of specs/qtile_shadows.kspec, whose second chunk here reads
    # the window ring)
    assert kp.schedule.value == "query_tile", kp.name
    step = cache.max_prefill_chunk()
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        ref.append(kn[lo:hi], vn[lo:hi], host, lo, sink, win)
        floor = (ref.prefill_live_floor(lo, hi - lo, cache.RING_ROWS)
                 if kp.ring_floor.value == "batch" else None)
        want = ref.prefill_attention_cache(q[lo:hi], host, G, lo, sink, win, 0, 0, scale,
                                           floor, tile=kp.tile_keys)
        np.testing.assert_allclose(got[lo:hi], want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{kv}/{v_kv} prefill {kp.name} rows {lo}..{hi} "
                                   f"seed={seed}")
    kd = cache.kernels.get("decode", G)[0]
    assert kd.mixed and kd.stream_loads.value == "hoisted", kd.name  # the default decode
    for pos, plan in ((n, {"kps": 64, "splits_cap": 4}), (n + 1, {}), (n + 2, {})):
        qd, k1, v1 = _rand(g, H, hd), _rand(g, 1, HK, hd), _rand(g, 1, HK, hd)
        got = cache.decode(cp.asarray(qd), cp.asarray(k1), cp.asarray(v1), pos=pos,
                           **plan).get()
        assert np.isfinite(got).all()
        ref.append(k1, v1, host, pos, sink, win)
        kr, vr = ref.read_kv_rows(host, pos, sink, win)
        kps, cap = cache.last_plan[:2]
        want = ref.decode_attention(qd, kr, vr, G, pos + 1, kps, cap, 0, 0, scale,
                                    tile=kd.tile_keys)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{kv}/{v_kv} decode {kd.name} at {pos} {plan} "
                                   f"seed={seed}")
