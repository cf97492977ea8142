"""The attention grid (kgen.testing.grid) on the GPU: each case prefills a query
batch at the end of its KV length through KVCache or PagedKVCache (kernels
chosen by shape and options), then decodes one token, against float64 NumPy
references. Run it alone with `bash tests/gpu/run_on_device.sh tests/gpu/test_grid.py`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.formats import FORMATS
from kgen.runtime import ContractError
from kgen.testing import rng
from kgen.testing.grid import grid

pytestmark = pytest.mark.gpu
RTOL, ATOL = 2e-4, 2e-5
HK = 2


def _rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("case", grid(list(FORMATS)), ids=str)
def test_grid(case):
    import cupy as cp

    from kgen.runtime.kv import KVCache
    from kgen.runtime.paged import PagedKVCache

    g, seed = rng()
    fmt = FORMATS[case.kv]
    if not fmt.accepts_head_dim(case.head_dim):
        pytest.skip(f"{case.kv} rows need head_dim % {fmt.block} == 0")
    H, hd, n, L = HK * case.gqa, case.head_dim, case.q_batch, case.kv_len
    opt = case.options()
    sinks = _rand(g, H) * 2 if opt.get("sinks") else None
    kw = {k: v for k, v in opt.items() if k != "sinks"}
    dev = {**kw, **({"sinks": cp.asarray(sinks)} if sinks is not None else {})}
    scales = {"k_scale": 0.5, "v_scale": 0.25} if fmt.tensor_scales else {}
    shadows = {"sink": 4, "win": 64} if fmt.shadows else {}
    kx, vx = _rand(g, L, HK, hd), _rand(g, L, HK, hd)
    q = _rand(g, n, H, hd)
    try:
        if case.layout == "paged":
            if fmt.shadows:
                pytest.skip("a paged cache keeps no fp16 shadows")
            cache = PagedKVCache(-(-(L + 2) // 16) + 1, 16, HK, hd, kv=case.kv, **scales)
            sid = cache.add()
            if n < L:
                cache.append([sid], cp.asarray(kx[: L - n]), cp.asarray(vx[: L - n]), [L - n])
            got = cache.prefill([sid], cp.asarray(q), cp.asarray(kx[L - n:]),
                                cp.asarray(vx[L - n:]), [n], **dev).get()
        else:
            cache = KVCache(HK, hd, L + 2, kv=case.kv, **shadows, **scales)
            if n < L:
                cache.append(cp.asarray(kx[: L - n]), cp.asarray(vx[: L - n]), pos0=0)
            got = cache.prefill(cp.asarray(q), cp.asarray(kx[L - n:]), cp.asarray(vx[L - n:]),
                                pos0=L - n, **dev).get()
    except ContractError as exc:
        pytest.skip(f"not served: {exc}")
    host = ref.HostCache.empty(fmt, HK, L + 2, hd, getattr(cache, "RING_ROWS", 0),
                               getattr(cache, "SINK_ROWS", 0), **scales)
    sink, win = shadows.get("sink", 0), shadows.get("win", 0)
    ref.fill(host, kx, vx, L - n, L, sink, win)
    scale = 1 / math.sqrt(hd)
    if case.layout == "paged":
        kp = cache.kernels.get("prefill_paged", case.gqa)[0]
    else:
        from kgen.runtime.kv import Options

        needs = Options(window=kw.get("window_size"), softcap=kw.get("softcap", 0.0),
                        sinks=sinks).needs("prefill")
        kp = cache.kernels.get("prefill", case.gqa, needs=needs)[0]
    floor = (ref.prefill_live_floor(L - n, n, cache.RING_ROWS)
             if kp.ring_floor.value == "batch" else None)
    want = ref.prefill_attention_cache(q, host, case.gqa, L - n, sink, win,
                                       kw.get("attn_sink", 0), 0, scale, floor,
                                       tile=kp.tile_keys, window=kw.get("window_size"),
                                       softcap=kw.get("softcap", 0.0), sinks=sinks)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                               err_msg=f"{case} prefill ({kp.name}) seed={seed}")
    # one decode step after the prefill
    q1, k1, v1 = _rand(g, H, hd), _rand(g, 1, HK, hd), _rand(g, 1, HK, hd)
    if case.layout == "paged":
        out = cache.decode([sid], cp.asarray(q1[None]), cp.asarray(k1), cp.asarray(v1), kps=64,
                           splits_cap=8, **dev).get()[0]
    else:
        out = cache.decode(cp.asarray(q1), cp.asarray(k1), cp.asarray(v1), pos=L, kps=64,
                           splits_cap=8, **dev).get()
    ref.append(k1, v1, host, L, sink, win)
    kr, vr = ref.read_kv_rows(host, L, sink, win)
    tile = (cache.kernels.get("decode_paged", case.gqa,
                              needs=_needs(kw, "decode_paged"))[0].tile_keys
            if case.layout == "paged" else
            cache.kernels.get("decode_dev", case.gqa, needs=_needs(kw, "decode_dev"))[0]
            .tile_keys)
    want = ref.decode_attention(q1, kr, vr, case.gqa, L + 1, 64, 8, kw.get("attn_sink", 0), 0,
                                scale, tile=tile, sinks=sinks, window=kw.get("window_size"),
                                softcap=kw.get("softcap", 0.0))
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL,
                               err_msg=f"{case} decode seed={seed}")


def _needs(kw, role):
    from kgen.runtime.kv import Options

    return Options(window=kw.get("window_size"), softcap=kw.get("softcap", 0.0)).needs(role)
