"""The engine's DFlash block attention as calls: ``dflash_block_attention`` and
``dflash_paged_block_attention``.

A speculative draft step verifies blocks of 1 + k query rows per request
(../shared/docs/engine-ops.md). Request r owns rows [cu_seqlens[r], cu_seqlens[r + 1])
of query (and of key / value, or block_key / block_value); each query attends only the
keys of its own block (dense), or the request's paged context (seq_lens[r] rows through
its block-table row) then its block, as one combined sequence (paged). causal = False:
every key; causal = True: keys j <= i, and j >= i - left with ``window_size=(left, 0)``
(FlashAttention's spelling; the kernels' sliding_window is left + 1, and block_causal
the causal flag), over positions inside the block
(paged: the combined index, block query i at seq_lens[r] + i). Over the materialized
[context ; block], the paged call gives the dense call's bits.

Elements: query and every key and value array (key / value; block_key, block_value,
ctx_key, ctx_value) share one element type, float32, bf16 (its bit patterns, uint16:
kgen.formats.bf16) or float16 (kgen.ir.axes.IoDtype: in_dtype, read off query); out is
float32 or that same type (out_dtype, read off out; rounded to nearest even). Each
element is widened exactly as it is loaded and the math is f32, so the paged call still
gives the dense call's bits over [context ; block] for every pair. The kernel is chosen
by the two element types; another pair (a 16-bit output of other inputs) is refused.

cu_seqlens, seq_lens and block_table are int32 device arrays the kernel reads in place:
the launch grid comes from the query's rows alone, so the launch can be captured in a
CUDA graph. Before any launch, every launch contract is checked (kgen.runtime.bind:
dtypes, contiguity, shapes, the scalars' ranges) and, with ``validate`` (the default),
the index arrays are read back and checked too (rising cu_seqlens within the rows,
context lengths within the block table, the pages they use within the cache); a
graph-captured call passes ``validate=False`` and owns their contents (the kernel then
writes NaN rows for a request whose entries break them, zeros for rows outside every
request, and never reads out of bounds).
"""

from __future__ import annotations

import numpy as np

from kgen.ir.axes import IoDtype, KeySource, Op
from kgen.ir.params import INT_MAX, PARAMS
from kgen.runtime.bind import bind
from kgen.runtime.contracts import Checker, ContractError
from kgen.runtime.convention import public, read_back, softmax_scale, window_size
from kgen.runtime.options import flag, io_dtype
from kgen.runtime.select import Role, find

_CHOSEN: dict[tuple, tuple] = {}  # (source, in, out, head_dim, variant) -> (kernel, launcher)
WHO = "kgen.runtime.dflash"


def role(source: KeySource, in_dtype: IoDtype = IoDtype.F32,
         out_dtype: IoDtype = IoDtype.F32) -> Role:
    """What a call needs a kernel for: the dense or the paged key source, and the element
    types of its inputs (in_dtype) and of its output (out_dtype)."""
    return Role(Op.DFLASH_ATTENTION, needs=(("in_dtype", in_dtype.value),
                                            ("key_source", source.value),
                                            ("out_dtype", out_dtype.value)))


def launcher(source: KeySource, head_dim: int, variant: str | None = None,
             in_dtype: IoDtype = IoDtype.F32, out_dtype: IoDtype = IoDtype.F32):
    """(kernel, generated launcher) serving ``source`` over ``in_dtype`` inputs and an
    ``out_dtype`` output at ``head_dim`` (``variant``: a kernel name, checked to serve
    it); chosen once per shape, then kept."""
    key = (source, in_dtype, out_dtype, head_dim, variant)
    hit = _CHOSEN.get(key)
    if hit is None:
        hit = _CHOSEN[key] = find(role(source, in_dtype, out_dtype), head_dim, 1, variant)
    return hit


def dtypes(query, out) -> tuple[IoDtype, IoDtype]:
    """(in_dtype, out_dtype) of a call: query's and out's element types (IoDtype), out
    float32 or query's own type; a ContractError (dtype) otherwise. The key and value
    arrays must hold query's type (bind checks each against the chosen kernel)."""
    fi, fo = io_dtype("query", query, WHO), io_dtype("out", out, WHO)
    check_out_dtype(fi, fo)
    return fi, fo


def check_out_dtype(fi: IoDtype, fo: IoDtype) -> None:
    """A DFlash output is float32, or of the inputs' element type."""
    if fo is not IoDtype.F32 and fo is not fi:
        raise ContractError(WHO, "dtype", f"out holds {fo.value} elements: the output is "
                            f"f32 or the inputs' element type (query: {fi.value})")


def _head_dim(query) -> int:
    shape = getattr(query, "shape", None)
    return int(shape[-1]) if shape is not None and len(shape) == 3 else 1


def _num_reqs(c: Checker, num_reqs, cu_seqlens) -> None:
    if num_reqs is None:
        return
    n = c.integer("num_reqs", num_reqs, 1)
    have = int(cu_seqlens.shape[0]) - 1
    c.require(n == have, "shape", lambda: f"num_reqs = {n}, but cu_seqlens has {have + 1} "
              f"entries (pass cu_seqlens[:{n + 1}])")


def _host(x) -> np.ndarray:
    return np.asarray(x.get() if hasattr(x, "get") else x).astype(np.int64)


def check_rows(c: Checker, cu: np.ndarray, rows: int) -> None:
    """cu_seqlens rises (never falls) from >= 0 to <= the query's rows."""
    c.require(bool(cu[0] >= 0 and cu[-1] <= rows and (np.diff(cu) >= 0).all()), "cu_seqlens",
              lambda: f"cu_seqlens must rise from >= 0 to <= the {rows} query rows, got "
              f"{cu.tolist()[:8]}{' ...' if cu.size > 8 else ''}")


def check_pages(c: Checker, lens: np.ndarray, table: np.ndarray, num_pages: int,
                block_size: int) -> None:
    """Each request's context fits its block-table row and maps pages of the cache."""
    mb = table.shape[1]
    c.require(bool(((lens >= 0) & (lens <= mb * block_size)).all()), "seq_lens",
              lambda: f"seq_lens must lie in [0, {mb * block_size}] (the table's {mb} "
              f"blocks of {block_size}), got {lens.min()}..{lens.max()}")
    for r, n in enumerate(lens):
        used = table[r, : -(-int(n) // block_size)]
        c.require(bool(((used >= 0) & (used < num_pages)).all()), "block_table",
                  lambda r=r: f"request {r} maps a page outside [0, {num_pages})")


def sliding_window(window, causal: bool) -> int:
    """The kernels' sliding_window from the public ``window_size`` (FlashAttention's
    (left, right), kgen.runtime.convention.window_size): (left, 0) or (left, -1) under
    causal = True is keys j >= i - left, the kernels' window of left + 1; no window: 0."""
    win = window_size(window, WHO)
    if win is None:
        return 0
    left, right = win
    if left == right == INT_MAX:  # (-1, -1): no window on either side
        return 0
    if not 0 <= left <= INT_MAX:
        raise ContractError(WHO, "window_size", f"window_size = {tuple(window)}: left is "
                            f">= 0 (-1: no bound), at most {INT_MAX}")
    if not causal or right not in (0, INT_MAX):
        raise ContractError(WHO, "window_size", f"window_size = {tuple(window)}: the DFlash "
                            "kernels serve a window (left, 0) with causal=True only")
    return 0 if left >= INT_MAX else left + 1


def _scalars(query, causal, window, scale) -> dict:
    causal = flag("causal", causal, WHO)
    return dict(block_causal=causal, sliding_window=sliding_window(window, bool(causal)),
                scale=softmax_scale(scale, _head_dim(query)))


@public(WHO, arrays=("out", "query", "key", "value", "cu_seqlens"))
def dflash_block_attention(out, query, key, value, cu_seqlens, *, scale: float | None = None,
                           causal: bool = bool(PARAMS["block_causal"].default),
                           window_size: tuple[int, int] | None = None,
                           num_reqs: int | None = None, validate: bool | None = None,
                           stream=None, variant: str | None = None):
    """DFlashBlockAttention: ``out`` [T, Hq, D] from query [T, Hq, D] over key / value
    [T, Hkv, D] (C-contiguous CuPy arrays: query, key, value float32, uint16 bf16 bits
    or float16 alike; out float32 or query's type), request r's block being rows
    [cu_seqlens[r], cu_seqlens[r + 1]) (cu_seqlens: int32 [num_reqs + 1], on the
    device). Returns the bound kgen.runtime.Launch; a broken contract raises
    kgen.runtime.ContractError before any launch."""
    fi, fo = dtypes(query, out)
    k, fn = launcher(KeySource.DENSE, _head_dim(query), variant, fi, fo)
    scalars = _scalars(query, causal, window_size, scale)
    c = Checker(WHO)
    bind(k, dict(out=out, query=query, key=key, value=value, cu_seqlens=cu_seqlens,
                 **scalars))
    _num_reqs(c, num_reqs, cu_seqlens)
    validate = read_back(validate, stream, WHO)
    if validate:
        check_rows(c, _host(cu_seqlens), int(query.shape[0]))
    return fn(out, query, key, value, cu_seqlens, **scalars, stream=stream)


@public(WHO, arrays=("out", "query", "block_key", "block_value", "ctx_key", "ctx_value",
                     "cu_seqlens", "seq_lens", "block_table"))
def dflash_paged_block_attention(out, query, block_key, block_value, ctx_key, ctx_value,
                                 cu_seqlens, seq_lens, block_table, *,
                                 scale: float | None = None,
                                 causal: bool = bool(PARAMS["block_causal"].default),
                                 window_size: tuple[int, int] | None = None,
                                 num_reqs: int | None = None, block_size: int | None = None,
                                 validate: bool | None = None, stream=None,
                                 variant: str | None = None):
    """DFlashPagedBlockAttention: ``out`` [T, Hq, D] from query [T, Hq, D] over each
    request's context (ctx_key / ctx_value pages [num_pages, block_size, Hkv, D], its
    seq_lens[r] rows through block_table[r]) then its block (block_key / block_value
    [T, Hkv, D], rows [cu_seqlens[r], cu_seqlens[r + 1])). C-contiguous CuPy arrays:
    query and the key / value arrays float32, uint16 bf16 bits or float16 alike, out
    float32 or query's type, the index arrays int32. Returns the bound
    kgen.runtime.Launch; a broken contract raises kgen.runtime.ContractError before any
    launch."""
    fi, fo = dtypes(query, out)
    k, fn = launcher(KeySource.PAGED, _head_dim(query), variant, fi, fo)
    scalars = _scalars(query, causal, window_size, scale)
    c = Checker(WHO)
    b = bind(k, dict(out=out, query=query, block_key=block_key, block_value=block_value,
                     ctx_key=ctx_key, ctx_value=ctx_value, cu_seqlens=cu_seqlens,
                     seq_lens=seq_lens, block_table=block_table, **scalars))
    _num_reqs(c, num_reqs, cu_seqlens)
    bs = int(b.arg("block_size"))
    if block_size is not None:
        given = c.integer("block_size", block_size, 1)
        c.require(given == bs, "shape", lambda: f"block_size = {given}, but the context "
                  f"pages hold {bs} positions")
    validate = read_back(validate, stream, WHO)
    if validate:
        check_rows(c, _host(cu_seqlens), int(query.shape[0]))
        check_pages(c, _host(seq_lens), _host(block_table), int(b.arg("num_pages")), bs)
    return fn(out, query, block_key, block_value, ctx_key, ctx_value, cu_seqlens, seq_lens,
              block_table, **scalars, stream=stream)
