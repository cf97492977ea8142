"""Mixed K/V caches on a GPU (K rows in one format, V rows in another: specs/mixed.kspec):
a chunked prefill then decode steps through KVCache, and a varlen prefill then decode
of several sequences through PagedKVCache, each against the float64 reference over
the rows the kernels read (each role through its own format's model, V's shadows where
its format keeps them); and the paged gate: on one contiguous sequence the paged
kernels give the dense ones' bits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.formats import pair
from kgen.runtime import ContractError
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
@pytest.mark.parametrize("n", [24, 300], ids=["per_row", "query_tiles"])
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
    tiles = n == 300 and not pair(kv, v_kv).shadows  # rows that fill the query tiles
    assert kp.schedule.value == ("query_tile" if tiles else "block_tile"), kp.name
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


@pytest.mark.parametrize("kv, v_kv", _pairs("paged"))
def test_mixed_paged_prefill_then_decode_every_sequence(kv, v_kv):
    import cupy as cp

    from kgen.runtime.paged import PagedKVCache

    g, seed = rng()
    cache = PagedKVCache(64, 16, HK, HD, kv=kv, v_kv=v_kv, max_blocks_per_seq=16)
    sids = [cache.add() for _ in range(3)]
    hosts = {s: [] for s in sids}
    scale, G = 1 / math.sqrt(HD), H // HK

    def dense(s):
        kx = np.concatenate([r[0] for r in hosts[s]])
        vx = np.concatenate([r[1] for r in hosts[s]])
        c = ref.HostCache.empty(cache.pair, HK, len(kx), HD)
        ref.append(kx, vx, c, 0)
        return c

    for rows in ([40, 5, 17], [3, 150, 1]):  # the second chunk fills query tiles
        q = _rand(g, sum(rows), H, HD)
        kn, vn = _rand(g, sum(rows), HK, HD), _rand(g, sum(rows), HK, HD)
        out = cache.prefill(sids, cp.asarray(q), cp.asarray(kn), cp.asarray(vn), rows).get()
        lo = 0
        for s, n in zip(sids, rows, strict=True):
            hosts[s].append((kn[lo:lo + n], vn[lo:lo + n]))
            c = dense(s)
            want = ref.prefill_attention_cache(q[lo:lo + n], c, G, c.max_seq - n, 0, 0, 0, 0,
                                               scale)
            np.testing.assert_allclose(out[lo:lo + n], want, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{kv}/{v_kv} prefill seq {s} seed={seed}")
            lo += n
    for _ in range(2):
        q = _rand(g, 3, H, HD)
        kn, vn = _rand(g, 3, HK, HD), _rand(g, 3, HK, HD)
        out = cache.decode(sids, cp.asarray(q), cp.asarray(kn), cp.asarray(vn), kps=16,
                           splits_cap=4).get()
        for i, s in enumerate(sids):
            hosts[s].append((kn[i:i + 1], vn[i:i + 1]))
            c = dense(s)
            kr, vr = ref.read_kv_rows(c, c.max_seq - 1)
            want = ref.decode_attention(q[i], kr, vr, G, c.max_seq, 16, 4, 0, 0, scale)
            np.testing.assert_allclose(out[i], want, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{kv}/{v_kv} decode seq {s} seed={seed}")


@pytest.mark.parametrize("kv, v_kv", _pairs("paged"))
def test_mixed_paged_is_bit_exact_with_dense_on_one_sequence(kv, v_kv):
    import cupy as cp

    from kgen.runtime.kv import KVCache
    from kgen.runtime.paged import PagedKVCache

    g, seed = rng()
    paged = PagedKVCache(32, 16, HK, HD, kv=kv, v_kv=v_kv)
    paged.free_blocks = list(g.permutation(32).tolist())  # scattered physical blocks
    sid = paged.add()
    dense = KVCache(HK, HD, 256, kv=kv, v_kv=v_kv)
    for n in (70, 130):  # a per-row prefill, then one that fills query tiles
        pos0 = dense.length
        q, kn, vn = _rand(g, n, H, HD), _rand(g, n, HK, HD), _rand(g, n, HK, HD)
        try:
            b = dense.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=pos0).get()
        except ContractError as exc:
            pytest.fail(f"no dense {kv}/{v_kv} prefill: {exc}")
        a = paged.prefill([sid], cp.asarray(q), cp.asarray(kn), cp.asarray(vn), [n]).get()
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
            f"{kv}/{v_kv} prefill of {n} rows ({dense.last_prefill}), seed={seed}"
    for plan in ({"kps": 32, "splits_cap": 4}, {}):
        pos = dense.length
        q1, k1, v1 = _rand(g, 1, H, HD), _rand(g, 1, HK, HD), _rand(g, 1, HK, HD)
        a = paged.decode([sid], cp.asarray(q1), cp.asarray(k1), cp.asarray(v1),
                         **plan).get()[0]
        b = dense.decode(cp.asarray(q1[0]), cp.asarray(k1), cp.asarray(v1), pos=pos,
                         **plan).get()
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
            f"{kv}/{v_kv} decode {plan or 'default plan'}, seed={seed}"
