"""The device side of a GPU check: host arrays up to the GPU, NaN-poisoned outputs
(an element the kernel never writes stays NaN), and the comparison of what came
back with the float64 NumPy reference."""

from __future__ import annotations

import numpy as np

RTOL, ATOL = 2e-4, 2e-5  # float32 accumulation in tile order vs float64


def cupy():
    import cupy

    return cupy


def dev(x: np.ndarray):
    return cupy().asarray(x)


def poisoned(shape, dtype=np.float32):
    a = cupy().empty(shape, dtype)
    a.fill(np.nan if np.dtype(dtype).kind == "f" else 0xAB)
    return a


def assert_close(name, got, want, seed, rtol=RTOL, atol=ATOL):
    got = np.asarray(got, dtype=np.float64)
    assert not np.isnan(got).any(), f"{name}: NaN left in output (unwritten element) seed={seed}"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                               err_msg=f"{name} differs from the NumPy reference, seed={seed}")


def poisoned_as(shape, fmt):
    """An array of ``fmt``'s elements (an in_dtype / out_dtype format) every element of
    which decodes to NaN: an element a kernel never writes stays NaN."""
    a = cupy().empty(shape, np.dtype(fmt.dtype))
    a.fill(fmt.poison())
    return a


def assert_close_as(name, fmt, got, want, seed, rtol=RTOL, atol=ATOL):
    """``got``, elements of ``fmt`` (an out_dtype's format), within the f32 tolerance of the
    float64 ``want`` plus the format's rounding of it (its error model,
    ``KvFormat.round_trip_bound``; none for f32); no element left NaN."""
    got = fmt.dequantize_rows(np.asarray(got)).astype(np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert not np.isnan(got).any(), f"{name}: NaN left in output (unwritten element) seed={seed}"
    _, rounding = fmt.round_trip_bound(want, None)
    allowed = atol + rtol * np.abs(want) + 1.01 * rounding
    err = np.abs(got - want)
    bad = int(np.count_nonzero(~(err <= allowed)))
    assert bad == 0, (f"{name} differs from the NumPy reference at {bad} of {got.size} "
                      f"elements (worst {float(np.max(err - allowed)):.3g} past the bound), "
                      f"seed={seed}")
