"""The dense_attention kernels' tests (AttentionDenseFast, AttentionDenseFlash): their
arguments on the host (contracts), the GPU check of every output element against the
float64 reference (kgen.numpy_ref.attention_dense, from the engine's definition) and
the relation check, bit for bit, of two kernels (the Flash kernel against the Fast
kernel) on the same inputs.

A case's ``n`` is the sequence length T, ``n_head`` / ``n_head_kv`` the q and kv heads,
``causal`` the mask. Inputs are fresh random numbers from a seed the failure names
(KGEN_TEST_SEED replays it), in the kernel's in_dtype (bf16: rounded by the format's
NumPy model, the reference reading the values the kernel holds); outputs are poisoned
with the out_dtype's NaN before each launch, and the uploads are synchronized with the
device before it. A bf16 output is allowed its rounding (the format's error model) on
top of the f32 tolerance.
"""

from __future__ import annotations

import math

import numpy as np

from kgen import numpy_ref as ref
from kgen.ir.kernel import Kernel
from kgen.testing.case import Case, rng
from kgen.testing.device import ATOL, RTOL, assert_close_as, cupy, dev, poisoned


def host_args(k: Kernel, case: Case, alloc=np.zeros) -> dict:
    """A valid argument set for ``bind`` (contents irrelevant)."""
    T, H, Hk, D = case.n, case.n_head, case.n_head_kv, case.head_dim
    fi, fo = k.in_dtype.fmt, k.out_dtype.fmt
    return dict(out=alloc((T, H, D), np.dtype(fo.dtype)),
                query=alloc((T, H, D), np.dtype(fi.dtype)),
                key=alloc((T, Hk, D), np.dtype(fi.dtype)),
                value=alloc((T, Hk, D), np.dtype(fi.dtype)),
                block_causal=int(case.causal), scale=scale_of(case))


def scale_of(case: Case) -> float:
    return 1.0 / math.sqrt(case.head_dim)


def inputs(g: np.random.Generator, case: Case, k: Kernel) -> dict:
    """(name -> the kernel's in_dtype array) for query, key, value."""
    T, H, Hk, D = case.n, case.n_head, case.n_head_kv, case.head_dim
    fi = k.in_dtype.fmt
    shapes = dict(query=(T, H, D), key=(T, Hk, D), value=(T, Hk, D))
    return {n: fi.quantize_rows(g.standard_normal(s).astype(np.float32))
            for n, s in shapes.items()}


def run(k: Kernel, fn, case: Case, x: dict) -> np.ndarray:
    """The kernel's output (out_dtype's elements) over the inputs ``x``."""
    fo = k.out_dtype.fmt
    out = poisoned((case.n, case.n_head, case.head_dim), np.dtype(fo.dtype))
    out.fill(fo.poison())  # decodes to NaN: an element never written stays NaN
    args = [dev(x[n]) for n in ("query", "key", "value")]
    _sync()  # uploads done before the launch's stream runs
    fn(out, *args, block_causal=int(case.causal), scale=scale_of(case))
    return out.get()


def _sync():
    cupy().cuda.Device().synchronize()


def tolerance(case: Case) -> tuple[float, float]:
    """(rtol, atol): the kernel tests', the atol grown with the square root of the
    sequence past 1024 keys (f32 sums over thousands of keys)."""
    return RTOL, ATOL * max(1.0, math.sqrt(case.n / 1024))


def check(k: Kernel, fn, case: Case) -> None:
    g, seed = rng()
    x = inputs(g, case, k)
    fi, fo = k.in_dtype.fmt, k.out_dtype.fmt
    want = ref.attention_dense(*(fi.dequantize_rows(x[n]) for n in ("query", "key", "value")),
                               scale_of(case), case.causal)
    rtol, atol = tolerance(case)
    assert_close_as(k.name, fo, run(k, fn, case, x), want, seed, rtol, atol)


def relation(kind: str, tolerance_: float, ka: Kernel, fa, kb: Kernel, fb,
             case: Case) -> None:
    """Both kernels on the same inputs: the same output bits (bit_exact), or within
    ``tolerance_`` of the largest output magnitude (close_to)."""
    g, seed = rng()
    x = inputs(g, case, ka)
    a, b = run(ka, fa, case, x), run(kb, fb, case, x)
    fo = ka.out_dtype.fmt
    fa_, fb_ = fo.dequantize_rows(a), fo.dequantize_rows(b)
    assert not np.isnan(fa_).any() and not np.isnan(fb_).any(), f"NaN in outputs, seed={seed}"
    if kind == "bit_exact":
        diff = int(np.count_nonzero(a != b))
        assert diff == 0, (f"{ka.name} vs {kb.name}: {diff} of {a.size} elements differ, "
                           f"seed={seed}")
    else:
        fa_, fb_ = fa_.astype(np.float64), fb_.astype(np.float64)
        err = float(np.max(np.abs(fa_ - fb_)) / max(np.max(np.abs(fb_)), 1e-30))
        assert err <= tolerance_, f"{ka.name} vs {kb.name}: relative error {err:.3g} > " \
                                  f"{tolerance_:g}, seed={seed}"
