"""The engine's DFlash block attention in float64, from its definition
(../shared/docs/engine-ops.md), not from a kernel.

``dflash_block_attention``: request r owns rows [cu_seqlens[r], cu_seqlens[r + 1]) of
query, key and value; its query i attends only keys of its own block: every one
(causal = false), or keys j <= i and j >= i - (window - 1) (causal = true; window <= 0:
plain causal), positions being offsets inside the block. q head h reads kv head
h / (Hq / Hkv). out = softmax(scale * q . k) . v over the visible keys.

``dflash_paged_block_attention``: the queries of request r's block attend over one
combined sequence, its context (seq_lens[r] = C_r rows, from the pages through the
block table) then its block (len_r rows); block query i sits at combined position
C_r + i, and the mask above applies over the combined index.

Rows outside every request are zeros (what the kernels write there).

Inputs may be 16-bit (the kernels' in_dtype): float16 values, or bf16 as its bit
patterns (uint16, the top half of a float32); both are widened exactly (``widen``), so
the reference sees the values a kernel computes with.
"""

from __future__ import annotations

import numpy as np


def widen(x) -> np.ndarray:
    """An input array as float64 values: floats as they are, uint16 as bf16 bit patterns
    (shifted into a float32's top half: exact)."""
    x = np.asarray(x)
    if x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, scale: float,
            causal: bool, window: int) -> np.ndarray:
    """q [n, Hq, D] at positions ``pos`` over keys k, v [L, Hkv, D] (positions 0..L-1)."""
    n, Hq, D = q.shape
    L, Hkv, _ = k.shape
    G = Hq // Hkv
    kh = np.repeat(k, G, axis=1)  # [L, Hq, D]: q head h reads kv head h // G
    vh = np.repeat(v, G, axis=1)
    s = np.einsum("nhd,lhd->hnl", q, kh) * scale  # [Hq, n, L]
    j = np.arange(L)[None, :]
    p = pos[:, None]
    visible = np.ones((n, L), bool)
    if causal:
        visible = j <= p
        if window > 0:
            visible &= j >= p - (window - 1)
    s = np.where(visible[None], s, -np.inf)
    s -= s.max(axis=-1, keepdims=True)
    w = np.exp(s)
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("hnl,lhd->nhd", w, vh)


def dflash_block_attention(query, key, value, cu_seqlens, scale: float, causal: bool,
                           sliding_window: int = 0) -> np.ndarray:
    """out ``[T][Hq][D]``, float64."""
    q, k, v = widen(query), widen(key), widen(value)
    cu = np.asarray(cu_seqlens, np.int64)
    out = np.zeros(q.shape)
    for r in range(len(cu) - 1):
        a, b = int(cu[r]), int(cu[r + 1])
        if b > a:
            out[a:b] = _attend(q[a:b], k[a:b], v[a:b], np.arange(b - a), scale, causal,
                               sliding_window)
    return out


def gather_context(ctx, block_table_row, n: int) -> np.ndarray:
    """Context rows [0, n) of one request: pages [num_pages][block_size][Hkv][D] read
    through its block-table row."""
    ctx = np.asarray(ctx)
    bs = ctx.shape[1]
    j = np.arange(n)
    return ctx[np.asarray(block_table_row)[j // bs], j % bs]


def dflash_paged_block_attention(query, block_key, block_value, ctx_key, ctx_value,
                                 cu_seqlens, seq_lens, block_table, scale: float,
                                 causal: bool, sliding_window: int = 0) -> np.ndarray:
    """out ``[T][Hq][D]``, float64."""
    q, bk, bv = widen(query), widen(block_key), widen(block_value)
    cu = np.asarray(cu_seqlens, np.int64)
    out = np.zeros(q.shape)
    for r in range(len(cu) - 1):
        a, b = int(cu[r]), int(cu[r + 1])
        if b <= a:
            continue
        C = int(seq_lens[r])
        k = np.concatenate([widen(gather_context(ctx_key, block_table[r], C)), bk[a:b]])
        v = np.concatenate([widen(gather_context(ctx_value, block_table[r], C)), bv[a:b]])
        out[a:b] = _attend(q[a:b], k, v, C + np.arange(b - a), scale, causal, sliding_window)
    return out
