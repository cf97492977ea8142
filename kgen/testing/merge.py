"""The merge_attn_states kernels' tests: their arguments on the host (contracts), the
LSE patterns a case asks for (``Case.lse_pattern``) and the GPU check against the
float64 reference (kgen.numpy_ref.merge, written from the engine's definition).

Outputs are ``[T][H][Dv]`` (``Case.n`` tokens, ``n_head``, ``head_dim``), LSEs
``[H][T]``. The GPU check poisons every output with NaN, compares the merged values
within the kernel tests' tolerance and checks bit for bit what the definition passes
through verbatim: the suffix (output and LSE) of tokens at or past
``prefill_tokens_with_context``, and the prefix (with an LSE of -inf) of rows whose
two LSEs are both empty (-inf, or +inf, which counts as -inf). The outputs' element
types are the kernel's (in_dtype for the two merged: random float32 values rounded by
the format's NumPy model, the reference reading the values the kernel holds; out_dtype
for the merged one, allowed its rounding, the format's error model, on top of the f32
tolerance; what passes through verbatim is the value converted, bit for bit); LSEs f32.
"""

from __future__ import annotations

import numpy as np

from kgen import numpy_ref as ref
from kgen.ir.axes import Lse
from kgen.ir.kernel import Kernel
from kgen.testing.case import Case, bits_equal, rng
from kgen.testing.device import assert_close, assert_close_as, dev, poisoned, poisoned_as

INF = np.inf

# (what the row tests, (prefix LSE, suffix LSE) from a random base b): every edge the
# definition names (+inf as -inf, both empty, one side empty) and large differences
# (an exp that underflows to 0 or to a subnormal in f32), at large magnitudes too.
EDGES = (
    ("both -inf", lambda b, r: (-INF, -INF)),
    ("both +inf", lambda b, r: (INF, INF)),
    ("prefix +inf, suffix -inf", lambda b, r: (INF, -INF)),
    ("prefix -inf, suffix +inf", lambda b, r: (-INF, INF)),
    ("prefix +inf", lambda b, r: (INF, b)),
    ("suffix +inf", lambda b, r: (b, INF)),
    ("prefix -inf", lambda b, r: (-INF, b)),
    ("suffix -inf", lambda b, r: (b, -INF)),
    ("equal", lambda b, r: (b, b)),
    ("prefix 30 above", lambda b, r: (b + 30, b)),
    ("suffix 30 above", lambda b, r: (b, b + 30)),
    ("prefix 100 above (exp underflows)", lambda b, r: (b + 100, b)),
    ("suffix 200 above", lambda b, r: (b, b + 200)),
    ("both near 1e4", lambda b, r: (1e4 + b, 1e4 + b + 1)),
    ("both near -1e4", lambda b, r: (-1e4 + b, -1e4 + b - 2)),
    ("random", lambda b, r: (b, b + r)),
)


def lses(g: np.random.Generator, case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(prefix_lse, suffix_lse), ``[H][T]`` float32, as ``case.lse_pattern`` asks:
    ``random`` (typical log-sum-exps), ``wide`` (differences of tens to hundreds) or
    ``edges`` (every row one of EDGES, each present once there are as many rows)."""
    H, T = case.n_head, case.n
    if case.lse_pattern == "random":
        p, s = g.normal(2.0, 3.0, (H, T)), g.normal(2.0, 3.0, (H, T))
    elif case.lse_pattern == "wide":
        p, s = g.normal(0.0, 60.0, (H, T)), g.normal(0.0, 60.0, (H, T))
    elif case.lse_pattern == "edges":
        which = np.resize(np.arange(len(EDGES)), H * T)
        g.shuffle(which)
        base, rand = g.normal(0.0, 3.0, H * T), g.normal(0.0, 3.0, H * T)
        pairs = [EDGES[w][1](b, r) for w, b, r in zip(which, base, rand, strict=True)]
        p, s = (np.array(x, dtype=np.float64).reshape(H, T) for x in zip(*pairs, strict=True))
    else:
        raise ValueError(f"unknown lse_pattern {case.lse_pattern!r}")
    return p.astype(np.float32), s.astype(np.float32)


def inputs(g: np.random.Generator, case: Case, k: Kernel) -> tuple[np.ndarray, ...]:
    """(prefix_output, prefix_lse, suffix_output, suffix_lse) on the host: the outputs
    elements of the kernel's in_dtype, the LSEs float32."""
    T, H, D = case.n, case.n_head, case.head_dim
    fi = k.in_dtype.fmt
    p = fi.quantize_rows(g.standard_normal((T, H, D)).astype(np.float32))
    s = fi.quantize_rows(g.standard_normal((T, H, D)).astype(np.float32))
    p_lse, s_lse = lses(g, case)
    return p, p_lse, s, s_lse


def host_args(k: Kernel, case: Case, alloc=np.zeros) -> dict:
    """A valid argument set for ``bind`` (contents irrelevant)."""
    T, H, D = case.n, case.n_head, case.head_dim
    f32, ei, eo = np.float32, np.dtype(k.in_dtype.fmt.dtype), np.dtype(k.out_dtype.fmt.dtype)
    a = dict(output=alloc((T, H, D), eo), prefix_output=alloc((T, H, D), ei),
             suffix_output=alloc((T, H, D), ei), prefix_lse=alloc((H, T), f32),
             suffix_lse=alloc((H, T), f32),
             prefill_tokens_with_context=case.prefill_tokens_with_context)
    if k.lse is Lse.WRITE:
        a["output_lse"] = alloc((H, T), f32)
    return a


def verbatim(case: Case, p_lse: np.ndarray, s_lse: np.ndarray):
    """Masks ``[T][H]`` of the rows passed through unchanged: (suffix rows: tokens at or
    past prefill_tokens_with_context; prefix rows: both LSEs empty, not a suffix row)."""
    T = case.n
    suffix = np.zeros((T, case.n_head), bool)
    if case.prefill_tokens_with_context >= 0:
        suffix[case.prefill_tokens_with_context:] = True
    empty = (np.isinf(p_lse) & np.isinf(s_lse)).T
    return suffix, empty & ~suffix


def run(k: Kernel, fn, case: Case, p, p_lse, s, s_lse) -> tuple[np.ndarray, np.ndarray | None]:
    """Launch ``fn`` on NaN-poisoned outputs; returns (output, output_lse or None)."""
    out = poisoned_as(p.shape, k.out_dtype.fmt)
    outs = [out]
    lse = None
    if k.lse is Lse.WRITE:
        lse = poisoned(p_lse.shape)
        outs.append(lse)
    fn(*outs, dev(p), dev(p_lse), dev(s), dev(s_lse),
       prefill_tokens_with_context=case.prefill_tokens_with_context)
    return out.get(), None if lse is None else lse.get()


def check(k: Kernel, fn, case: Case) -> None:
    g, seed = rng()
    fi, fo = k.in_dtype.fmt, k.out_dtype.fmt
    p, p_lse, s, s_lse = inputs(g, case, k)
    got, got_lse = run(k, fn, case, p, p_lse, s, s_lse)
    pw, sw = fi.dequantize_rows(p), fi.dequantize_rows(s)  # the values the kernel holds
    want, want_lse = ref.merge_attn_states(pw, p_lse, sw, s_lse,
                                           case.prefill_tokens_with_context)
    assert_close_as(f"{k.name} output", fo, got, want, seed)
    suffix, prefix = verbatim(case, p_lse, s_lse)
    p_out, s_out = fo.quantize_rows(pw), fo.quantize_rows(sw)  # verbatim, as out_dtype
    assert bits_equal(got[suffix], s_out[suffix]), \
        f"{k.name}: tokens >= prefill_tokens_with_context are not the suffix verbatim, seed={seed}"
    assert bits_equal(got[prefix], p_out[prefix]), \
        f"{k.name}: rows with both LSEs empty are not the prefix verbatim, seed={seed}"
    if got_lse is not None:
        assert_close(f"{k.name} output_lse", got_lse, want_lse, seed)
        assert bits_equal(got_lse.T[suffix], s_lse.T[suffix]), \
            f"{k.name}: output_lse of the suffix tokens is not suffix_lse verbatim, seed={seed}"
        assert bool(np.isneginf(got_lse.T[prefix]).all()), \
            f"{k.name}: output_lse of rows with both LSEs empty is not -inf, seed={seed}"
