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
