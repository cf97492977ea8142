"""The dflash_attention kernels' tests: their arguments on the host (contracts), the
random requests a case asks for, the GPU check against the float64 reference
(kgen.numpy_ref.dflash, written from the engine's definition) and, for the paged
kernel, the bit-identity claim: the dense kernel over the materialized [context ;
block] rows of every request gives the paged kernel's bits (the dense kernel of the
same element types).

A case's ``requests`` are (block rows, context rows) per request (the dense kernel
reads the block rows only); ``pad_rows`` query rows follow the last request (outside
every request: the kernels write zeros there). Outputs are NaN-poisoned before each
launch, every element is compared, the inputs are fresh random numbers from a seed the
failure names (KGEN_TEST_SEED replays it), and the uploads are synchronized with the
device before the launch. Inputs are of the kernel's in_dtype (16-bit: float32 values
rounded by the format's NumPy model, so the reference reads the values the kernel
holds), outputs are poisoned with the out_dtype's NaN; a 16-bit output is allowed its
rounding (the format's error model) on top of the f32 tolerance.
"""

from __future__ import annotations

import math

import numpy as np

from kgen import numpy_ref as ref
from kgen.ir.axes import KeySource
from kgen.ir.kernel import Kernel
from kgen.ir.role import Role
from kgen.numpy_ref.dflash import gather_context
from kgen.testing.case import Case, bits_equal, rng
from kgen.testing.device import ATOL, RTOL, assert_close_as, cupy, dev, poisoned_as


def paged(k: Kernel) -> bool:
    return k.key_source is KeySource.PAGED


def block_lens(case: Case) -> list[int]:
    return [b for b, _ in case.requests]


def ctx_lens(case: Case) -> list[int]:
    return [c for _, c in case.requests]


def cu_seqlens(lens: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def rows(case: Case) -> int:
    return sum(block_lens(case)) + case.pad_rows


def page_shape(case: Case) -> tuple[int, int]:
    """(num_pages, max_blocks): every request's pages, one spare page, and a table row
    as wide as the longest context needs (at least one column)."""
    bs = case.block_size
    need = [-(-c // bs) for c in ctx_lens(case)]
    return sum(need) + 1, max([1, *need])


def host_args(k: Kernel, case: Case, alloc=np.zeros) -> dict:
    """A valid argument set for ``bind`` (contents irrelevant, except the index arrays,
    which are a valid layout when ``alloc`` makes storage): out of the kernel's out_dtype,
    query and the key / value arrays of its in_dtype."""
    T, H, Hk, D = rows(case), case.n_head, case.n_head_kv, case.head_dim
    fi, fo, i32 = np.dtype(k.in_dtype.fmt.dtype), np.dtype(k.out_dtype.fmt.dtype), np.int32
    a = dict(out=alloc((T, H, D), fo), query=alloc((T, H, D), fi),
             cu_seqlens=alloc((len(case.requests) + 1,), i32),
             block_causal=int(case.causal), sliding_window=case.sliding_window)
    names = ("block_key", "block_value") if paged(k) else ("key", "value")
    a.update({n: alloc((T, Hk, D), fi) for n in names})
    if paged(k):
        nb, mb = page_shape(case)
        a.update(ctx_key=alloc((nb, case.block_size, Hk, D), fi),
                 ctx_value=alloc((nb, case.block_size, Hk, D), fi),
                 seq_lens=alloc((len(case.requests),), i32),
                 block_table=alloc((len(case.requests), mb), i32))
    return a


def tables(g: np.random.Generator, case: Case) -> tuple[np.ndarray, np.ndarray, int]:
    """(seq_lens, block_table, num_pages): each request's context pages drawn at random
    from the cache (no page shared), table entries past its context -1 (never read)."""
    bs = case.block_size
    nb, mb = page_shape(case)
    pages = g.permutation(nb)
    table = np.full((len(case.requests), mb), -1, np.int32)
    at = 0
    for r, c in enumerate(ctx_lens(case)):
        n = -(-c // bs)
        table[r, :n] = pages[at:at + n]
        at += n
    return np.array(ctx_lens(case), np.int32), table, nb


def scale_of(case: Case) -> float:
    return 1.0 / math.sqrt(case.head_dim)


def _sync():
    cupy().cuda.Device().synchronize()  # uploads done before the launch's stream runs


def run_dense(k: Kernel, fn, case: Case, q, kx, vx, cu) -> np.ndarray:
    """The output (out_dtype's elements) of ``fn``, the launcher of a kernel with ``k``'s
    element types, over the inputs (in_dtype's elements)."""
    out = poisoned_as(q.shape, k.out_dtype.fmt)
    args = [dev(x) for x in (q, kx, vx, cu)]
    _sync()
    fn(out, *args, block_causal=int(case.causal), sliding_window=case.sliding_window,
       scale=scale_of(case))
    return out.get()


def run_paged(k: Kernel, fn, case: Case, q, bk, bv, ck, cv, cu, lens, table) -> np.ndarray:
    out = poisoned_as(q.shape, k.out_dtype.fmt)
    args = [dev(x) for x in (q, bk, bv, ck, cv, cu, lens, table)]
    _sync()
    fn(out, *args, block_causal=int(case.causal), sliding_window=case.sliding_window,
       scale=scale_of(case))
    return out.get()


def tolerance(case: Case) -> tuple[float, float]:
    """(rtol, atol): the kernel tests', the atol grown with the square root of the
    longest key sequence past 1024 keys (f32 sums over tens of thousands of keys)."""
    longest = max([1, *(b + c for b, c in case.requests)])
    return RTOL, ATOL * max(1.0, math.sqrt(longest / 1024))


def inputs(g: np.random.Generator, case: Case, k: Kernel) -> dict:
    """The case's random inputs: q and the key / value rows of the kernel's in_dtype,
    the index arrays int32."""
    T, H, Hk, D = rows(case), case.n_head, case.n_head_kv, case.head_dim

    def rand(*shape):
        return k.in_dtype.fmt.quantize_rows(g.standard_normal(shape).astype(np.float32))

    x = dict(q=rand(T, H, D), cu=cu_seqlens(block_lens(case)))
    if paged(k):
        lens, table, nb = tables(g, case)
        x.update(bk=rand(T, Hk, D), bv=rand(T, Hk, D), ck=rand(nb, case.block_size, Hk, D),
                 cv=rand(nb, case.block_size, Hk, D), lens=lens, table=table)
    else:
        x.update(kx=rand(T, Hk, D), vx=rand(T, Hk, D))
    return x


def materialize(case: Case, x: dict, g: np.random.Generator, k: Kernel):
    """The dense kernel's inputs over every request's [context ; block] rows: (q, key,
    value, cu_seqlens, the rows of the block queries in them), of ``k``'s in_dtype. The
    context rows' queries are random (their outputs are not compared)."""
    qs, ks, vs, at, lens = [], [], [], [], []
    base = 0
    cu = x["cu"]
    fi = k.in_dtype.fmt
    for r, (b, c) in enumerate(case.requests):
        a = int(cu[r])
        qs += [fi.quantize_rows(g.standard_normal((c, *x["q"].shape[1:])).astype(np.float32)),
               x["q"][a:a + b]]
        ks += [gather_context(x["ck"], x["table"][r], c), x["bk"][a:a + b]]
        vs += [gather_context(x["cv"], x["table"][r], c), x["bv"][a:a + b]]
        at.append(np.arange(base + c, base + c + b))
        lens.append(b + c)
        base += b + c
    return (np.concatenate(qs), np.concatenate(ks), np.concatenate(vs), cu_seqlens(lens),
            np.concatenate(at).astype(np.int64))


def dense_launcher(k: Kernel, find):
    """The generated dense kernel with the paged kernel's element types and arithmetic
    bounds (``find``: kgen.runtime.select.find, as the harness hands it)."""
    role = Role(k.op, needs=(("in_dtype", k.in_dtype.value), ("key_source", KeySource.DENSE.value),
                             ("out_dtype", k.out_dtype.value)))  # the op's role of a dense call
    return find(role, 1, 1, where=lambda d: (
        d.max_head_dim, d.keys_per_step) == (k.max_head_dim, k.keys_per_step))[1]


def differing(a: np.ndarray, b: np.ndarray) -> int:
    """Elements of ``a`` and ``b`` (one element type) whose bits differ."""
    u = np.dtype(f"u{a.dtype.itemsize}")
    return int(np.count_nonzero(a.view(u) != b.view(u)))


def check(k: Kernel, fn, case: Case, find) -> None:
    g, seed = rng()
    x = inputs(g, case, k)
    scale, nreq = scale_of(case), rows(case) - case.pad_rows
    if paged(k):
        got = run_paged(k, fn, case, x["q"], x["bk"], x["bv"], x["ck"], x["cv"], x["cu"],
                        x["lens"], x["table"])
        want = ref.dflash_paged_block_attention(
            x["q"], x["bk"], x["bv"], x["ck"], x["cv"], x["cu"], x["lens"], x["table"],
            scale, case.causal, case.sliding_window)
    else:
        got = run_dense(k, fn, case, x["q"], x["kx"], x["vx"], x["cu"])
        want = ref.dflash_block_attention(x["q"], x["kx"], x["vx"], x["cu"], scale,
                                          case.causal, case.sliding_window)
    rtol, atol = tolerance(case)
    assert_close_as(k.name, k.out_dtype.fmt, got, want, seed, rtol, atol)
    pad = k.out_dtype.fmt.dequantize_rows(got[nreq:])
    assert bits_equal(pad, np.zeros_like(pad)), \
        f"{k.name}: rows outside every request are not zeros, seed={seed}"
    if paged(k):  # the claim: the dense kernel's bits over [context ; block]
        q, kx, vx, cu, at = materialize(case, x, g, k)
        dense = run_dense(k, dense_launcher(k, find), case, q, kx, vx, cu)
        a, b = got[:nreq], dense[at]
        diff = differing(a, b)
        assert diff == 0, (f"{k.name} vs the dense kernel over [context ; block]: {diff} of "
                           f"{a.size} elements differ, seed={seed}")
