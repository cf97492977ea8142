"""The engine's multi-head latent attention ops in NumPy (float64 for the attention),
from their definitions (../shared/docs/engine-ops.md), not from a kernel.

The latent cache is pages ``[num_blocks][block_size][R]`` (R = kv_lora_rank + rope_dim),
one KV head; V is the first kv_lora_rank columns of a row.

* ConcatAndCacheMla: for token t < S with slot s = slot_mapping[t] >= 0, page s //
  block_size, row s % block_size gets kv_c[t] then k_pe[t]; a negative slot skips.
* GatherMlaCache: workspace row i (< N) of request b = token_to_seq[i] is the request's
  context row seq_starts[b] + i - cu_seq_lens[b] (seq_starts 0 when absent).
* MlaDecodeAttention: per request b and head h, over keys j < seq_lens[b],
  qk_j = scale * query[b, h] . row_j, out = sum_j softmax(qk)_j row_j[:kv_lora_rank],
  lse = max + log sum exp(qk - max).
* MlaPrefillAttention: varlen attention, H q heads = H kv heads, QK and V head sizes
  apart; causal is bottom-right aligned (query i of Lq sees keys j <= i + Lk - Lq).

The store and the gather move elements of any dtype (bf16 bit patterns, halves) exactly;
the attention references take the values a kernel computes with: for 16-bit rows, the
elements widened by the format's NumPy model (``KvFormat.dequantize_rows``, exact), so
the rounding of the inputs is modelled bit for bit and only the output's is a tolerance.
"""

from __future__ import annotations

import numpy as np


def concat_and_cache_mla(cache: np.ndarray, kv_c: np.ndarray, k_pe: np.ndarray,
                         slot_mapping: np.ndarray) -> np.ndarray:
    """The pages after the store (a copy; bytes exactly)."""
    out = np.array(cache, copy=True)
    nb, bs, _ = out.shape
    L = kv_c.shape[1]
    for t, s in enumerate(np.asarray(slot_mapping, dtype=np.int64)):
        if s < 0:
            continue
        out[s // bs, s % bs, :L] = kv_c[t]
        out[s // bs, s % bs, L:] = k_pe[t]
    return out


def request_rows(cache: np.ndarray, table_row: np.ndarray, first: int, count: int
                 ) -> np.ndarray:
    """Rows [first, first + count) of one request through its block-table row."""
    bs = cache.shape[1]
    pos = np.arange(first, first + count)
    return cache[np.asarray(table_row)[pos // bs], pos % bs]


def gather_mla_cache(cache: np.ndarray, block_table: np.ndarray, cu_seq_lens: np.ndarray,
                     token_to_seq: np.ndarray, seq_starts: np.ndarray | None,
                     num_tokens: int) -> np.ndarray:
    """The workspace rows [num_tokens][R] (bytes exactly)."""
    out = np.empty((num_tokens, cache.shape[2]), cache.dtype)
    for i in range(num_tokens):
        b = int(token_to_seq[i])
        start = 0 if seq_starts is None else int(seq_starts[b])
        out[i] = request_rows(cache, block_table[b], start + i - int(cu_seq_lens[b]), 1)[0]
    return out


def mla_decode(query: np.ndarray, cache: np.ndarray, block_table: np.ndarray,
               seq_lens: np.ndarray, scale: float, v_width: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(out [B][Hq][v_width], lse [B][Hq]) in float64."""
    q = np.asarray(query, dtype=np.float64)
    B, H, _ = q.shape
    out = np.zeros((B, H, v_width))
    lse = np.full((B, H), -np.inf)
    for b in range(B):
        n = int(seq_lens[b])
        if n <= 0:
            continue
        rows = request_rows(cache, block_table[b], 0, n).astype(np.float64)
        qk = scale * (q[b] @ rows.T)  # [H][n]
        m = qk.max(axis=1, keepdims=True)
        e = np.exp(qk - m)
        s = e.sum(axis=1, keepdims=True)
        out[b] = (e / s) @ rows[:, :v_width]
        lse[b] = (m + np.log(s))[:, 0]
    return out, lse


def mla_decode_partials(query: np.ndarray, cache: np.ndarray, block_table: np.ndarray,
                        seq_lens: np.ndarray, scale: float, v_width: int, splits: int,
                        split_keys) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The split stage's definition in float64: split s of request b holds keys
    [s * kps, min(L, (s + 1) * kps)), kps = split_keys(L, splits); per split the max m
    of its scores, l = sum exp(qk - m) and acc = sum exp(qk - m) v. Returns (m, l, acc,
    live): [B][Hq][S], [B][Hq][S], [B][Hq][S][v_width], and live [B][S] (the splits with
    keys; the others are not defined)."""
    q = np.asarray(query, dtype=np.float64)
    B, H, _ = q.shape
    m = np.full((B, H, splits), -np.inf)
    l_ = np.zeros((B, H, splits))
    acc = np.zeros((B, H, splits, v_width))
    live = np.zeros((B, splits), bool)
    for b in range(B):
        n = int(seq_lens[b])
        kps = split_keys(n, splits)
        if n <= 0 or kps <= 0:
            continue
        rows = request_rows(cache, block_table[b], 0, n).astype(np.float64)
        for s in range(splits):
            lo, hi = s * kps, min(n, (s + 1) * kps)
            if lo >= hi:
                continue
            live[b, s] = True
            qk = scale * (q[b] @ rows[lo:hi].T)
            mx = qk.max(axis=1)
            e = np.exp(qk - mx[:, None])
            m[b, :, s], l_[b, :, s] = mx, e.sum(axis=1)
            acc[b, :, s] = e @ rows[lo:hi, :v_width]
    return m, l_, acc, live


def mla_merge(m: np.ndarray, l_: np.ndarray, acc: np.ndarray, live: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """The merge stage's definition in float64 over the live splits of each request:
    M = max m_s, L = sum l_s exp(m_s - M), out = sum acc_s exp(m_s - M) / L,
    lse = M + log L; a row with no live split (or no finite max) gives 0 and -inf."""
    B, H, S = m.shape
    out = np.zeros((B, H, acc.shape[-1]))
    lse = np.full((B, H), -np.inf)
    for b in range(B):
        idx = np.flatnonzero(live[b])
        if idx.size == 0:
            continue
        mm = np.asarray(m[b][:, idx], dtype=np.float64)
        M = mm.max(axis=1)
        ok = np.isfinite(M)
        w = np.exp(mm[ok] - M[ok][:, None])
        L = (np.asarray(l_[b][:, idx], dtype=np.float64)[ok] * w).sum(axis=1)
        out[b, ok] = (np.asarray(acc[b][:, idx], dtype=np.float64)[ok] * w[:, :, None]
                      ).sum(axis=1) / L[:, None]
        lse[b, ok] = M[ok] + np.log(L)
    return out, lse


def mla_prefill(query: np.ndarray, key: np.ndarray, value: np.ndarray,
                cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, scale: float,
                causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """MlaPrefillAttention in float64: request r owns query rows [cu_q[r], cu_q[r+1]) and
    key rows [cu_k[r], cu_k[r+1]); per head, query i (of Lq) sees keys j < Lk, and with
    ``causal`` only j <= i + Lk - Lq (bottom-right aligned). Returns (out [total_q][H][Dv],
    lse [H][total_q]); a row that sees no key gives 0 and -inf."""
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    Tq, H, _ = q.shape
    out = np.zeros((Tq, H, v.shape[2]))
    lse = np.full((H, Tq), -np.inf)
    for r in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1])
        k0, k1 = int(cu_seqlens_k[r]), int(cu_seqlens_k[r + 1])
        Lq, Lk = q1 - q0, k1 - k0
        for i in range(Lq):
            n = min(Lk, i + Lk - Lq + 1) if causal else Lk
            if n <= 0:
                continue
            s = scale * np.einsum("hd,jhd->hj", q[q0 + i], k[k0:k0 + n])
            m = s.max(axis=1, keepdims=True)
            e = np.exp(s - m)
            tot = e.sum(axis=1, keepdims=True)
            out[q0 + i] = np.einsum("hj,jhd->hd", e / tot, v[k0:k0 + n])
            lse[:, q0 + i] = (m + np.log(tot))[:, 0]
    return out, lse
