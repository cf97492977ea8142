"""The engine's dense Attention over one sequence in float64, from its definition
(../shared/docs/engine-ops.md, engine-attention.md), not from a kernel.

query [T, Hq, D], key / value [T, Hkv, D]; q head h reads kv head h / (Hq / Hkv); the
queries and keys of one sequence (Lq = Lk = T, so bottom-right alignment puts query i
at position i): causal = False, every key; causal = True, keys j <= i. out =
softmax(scale * q . k) . v over the visible keys. AttentionDenseFast and
AttentionDenseFlash compute this (bf16 inputs: the values they hold, widened exactly).
"""

from __future__ import annotations

import numpy as np

from .dflash import _attend


def attention_dense(query, key, value, scale: float, causal: bool) -> np.ndarray:
    """out ``[T][Hq][D]``, float64 (the definition is dflash's over one block of T rows,
    no window)."""
    q = np.asarray(query, np.float64)
    return _attend(q, np.asarray(key, np.float64), np.asarray(value, np.float64),
                   np.arange(q.shape[0]), scale, causal, 0)
