"""Every code of a one-byte-an-element format through the kernels a KVCache chooses: the
cache's rows are written raw (every code, the NaN codes apart, in a random order), and
prefill and decode match float64 over the format's own decode of those bytes (the
format's NumPy model, kgen.formats). Where the format has NaN codes, one in V makes
exactly its column NaN, in the heads that read it. (The generated tests fill caches by
quantizing normal draws, so they reach few of the large codes and none of the NaNs.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.formats import FORMATS
from kgen.testing import rng
from kgen.testing.case import normal

pytestmark = pytest.mark.gpu
RTOL, ATOL = 2e-4, 2e-5
HEAD_DIMS = (64, 128, 256)  # the quads decodes' and query tiles' head sizes


def _code_formats() -> list[str]:
    """Formats whose rows are one byte an element, scaled per tensor, no shadows."""
    return [kv for kv, f in FORMATS.items() if f.itemsize == 1 and not f.blocked
            and f.tensor_scales and not f.shadows]


def _codes(fmt) -> tuple[np.ndarray, np.ndarray]:
    """(finite codes, NaN codes) of ``fmt``, from its model."""
    b = np.arange(256, dtype=np.uint8)
    nan = np.isnan(fmt.dequantize_rows(b[None, :])[0])
    return b[~nan], b[nan]


def _raw_rows(g, finite: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``shape`` bytes holding every finite code at least once, in a random order."""
    n = int(np.prod(shape))
    assert n >= finite.size
    out = np.concatenate([finite, g.choice(finite, n - finite.size)])
    return g.permutation(out).reshape(shape)


@pytest.mark.parametrize("hd", HEAD_DIMS)
@pytest.mark.parametrize("kv", _code_formats())
def test_every_code_reads_as_the_model(kv, hd):
    import cupy as cp

    from kgen.runtime.kv import KVCache

    g, seed = rng()
    fmt = FORMATS[kv]
    finite, nans = _codes(fmt)
    hk, G, ctx, n = 2, 4, 300, 24
    H = hk * G
    # Scales that keep the largest codes' scores and values moderate: the kernels' own
    # rounding then stays within the tolerance of the float64 reference.
    k_scale, v_scale = 2.0 ** -6, 0.5
    cache = KVCache(hk, hd, ctx + n + 1, kv=kv, k_scale=k_scale, v_scale=v_scale)
    host = ref.HostCache.empty(fmt, hk, ctx + n + 1, hd, k_scale=k_scale, v_scale=v_scale)
    scale = 1 / math.sqrt(hd)
    kx, vx = normal(g, (ctx, hk, hd)), normal(g, (ctx, hk, hd))
    cache.append(cp.asarray(kx), cp.asarray(vx), 0)
    ref.append(kx, vx, host, 0, 0, 0)
    for host_rows, dev_rows in ((host.k, cache.k), (host.v, cache.v)):
        host_rows[:, :ctx] = _raw_rows(g, finite, host_rows[:, :ctx].shape)
        dev_rows[:, :ctx] = cp.asarray(host_rows[:, :ctx])
    cp.cuda.runtime.deviceSynchronize()

    # prefill: n rows after the raw context
    q, kn, vn = normal(g, (n, H, hd)), normal(g, (n, hk, hd)), normal(g, (n, hk, hd))
    got = cache.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=ctx).get()
    kp = cache.kernels.get("prefill", G)[0]
    ref.append(kn, vn, host, ctx, 0, 0)
    want = ref.prefill_attention_cache(q, host, G, ctx, 0, 0, 0, 0, scale, tile=kp.tile_keys)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                               err_msg=f"{kv} hd{hd} prefill ({kp.name}) seed={seed}")

    # decode at ctx + n; a format's NaN codes in two columns of V (KV head 0, two keys)
    pos = ctx + n
    nan_at = np.zeros((H, hd), bool)
    if nans.size:
        cols = g.choice(hd, 2, replace=False)
        keys = g.choice(ctx, 2, replace=False)
        for code, key, col in zip(np.resize(nans, 2), keys, cols, strict=True):
            host.v[0, key, col] = code
            cache.v[0, int(key), int(col)] = int(code)
        nan_at[:G, cols] = True  # the q heads of KV head 0
    cp.cuda.runtime.deviceSynchronize()
    qd, kd, vd = normal(g, (H, hd)), normal(g, (1, hk, hd)), normal(g, (1, hk, hd))
    got = cache.decode(cp.asarray(qd), cp.asarray(kd), cp.asarray(vd), pos=pos).get()
    kdk = cache.kernels.get("decode", G)[0]
    kps, cap, _ = cache.last_plan
    ref.append(kd, vd, host, pos, 0, 0)
    kr, vr = ref.read_kv_rows(host, pos)
    want = ref.decode_attention(qd, kr, vr, G, pos + 1, kps, cap, 0, 0, scale, tile=kdk.tile_keys)
    assert np.array_equal(np.isnan(got), nan_at), f"{kv} hd{hd} decode NaNs, seed={seed}"
    assert np.array_equal(np.isnan(want), nan_at)
    np.testing.assert_allclose(got[~nan_at], want[~nan_at], rtol=RTOL, atol=ATOL,
                               err_msg=f"{kv} hd{hd} decode ({kdk.name}) seed={seed}")
