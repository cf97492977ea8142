"""The dense attention entry points on a GPU (kgen.runtime.attention_dense): each of
attention_dense_fast / attention_dense_flash, for every element-type pair built, against
the float64 reference of the definition; the two calls give the same bits; a call on a
non-default stream gives the default stream's bits; an explicit scale is honoured."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.formats import bf16
from kgen.runtime import attention_dense_fast, attention_dense_flash
from kgen.testing import rng

pytestmark = pytest.mark.gpu
RTOL, ATOL = 2e-4, 2e-5
F32, BF16 = np.float32, np.uint16


def _inputs(g, T, H, Hk, D, dt):
    x = [g.standard_normal(s).astype(np.float32) for s in ((T, H, D), (T, Hk, D), (T, Hk, D))]
    return [bf16.encode(a) for a in x] if dt == BF16 else x


def _floats(a):
    return bf16.decode(a) if a.dtype == BF16 else a


def _call(entry, x, out_dt, scale, causal, stream=None):
    import cupy as cp

    out = cp.full(x[0].shape, bf16.QUIET_NAN if out_dt == BF16 else np.nan, out_dt)
    d = [cp.asarray(a) for a in x]
    cp.cuda.Device().synchronize()
    entry(out, *d, scale=scale, causal=causal, stream=stream)
    cp.cuda.Device().synchronize()
    return out.get()


@pytest.mark.parametrize("io", [(F32, F32), (BF16, BF16), (BF16, F32)], ids=["f32", "bf16",
                                                                             "bf16_f32"])
@pytest.mark.parametrize("T, H, Hk, D, causal", [(197, 16, 16, 72, False),
                                                 (1500, 8, 8, 64, False),
                                                 (300, 12, 4, 80, True),
                                                 (129, 8, 1, 128, True)])
def test_entry_points_against_the_reference_and_each_other(io, T, H, Hk, D, causal):
    g, seed = rng()
    in_dt, out_dt = io
    x = _inputs(g, T, H, Hk, D, in_dt)
    scale = 0.7 / math.sqrt(D)
    fast = _call(attention_dense_fast, x, out_dt, scale, causal)
    flash = _call(attention_dense_flash, x, out_dt, scale, causal)
    want = ref.attention_dense(*(_floats(a) for a in x), scale, causal)
    got = _floats(fast).astype(np.float64)
    assert not np.isnan(got).any(), f"unwritten elements, seed={seed}"
    rounding = np.abs(want) * 2.0**-8 * 1.01 if out_dt == BF16 else 0.0
    atol = ATOL * max(1.0, math.sqrt(T / 1024))
    bad = np.abs(got - want) > atol + RTOL * np.abs(want) + rounding
    assert not bad.any(), f"{int(bad.sum())} of {got.size} elements off, seed={seed}"
    assert np.array_equal(fast, flash), (f"Flash differs from Fast at "
                                         f"{int(np.count_nonzero(fast != flash))} elements, "
                                         f"seed={seed}")


def test_a_stream_gives_the_default_streams_bits():
    import cupy as cp

    g, seed = rng()
    x = _inputs(g, 257, 4, 2, 64, F32)
    want = _call(attention_dense_flash, x, F32, None, True)
    s = cp.cuda.Stream(non_blocking=True)
    got = _call(attention_dense_flash, x, F32, None, True, stream=s)
    assert np.array_equal(want, got), f"seed={seed}"
    ref_ = ref.attention_dense(*x, 1 / math.sqrt(64), True)
    np.testing.assert_allclose(got, ref_, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")
