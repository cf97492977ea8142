"""The engine's MergeAttnStates in float64, from its definition
(../shared/docs/engine-ops.md), not from a kernel.

Two attention results over disjoint key sets, each with its log-sum-exp, merge as

    m = max(p_lse, s_lse); ps = exp(p_lse - m); ss = exp(s_lse - m)
    out = prefix * ps / (ps + ss) + suffix * ss / (ps + ss)
    out_lse = m + log(ps + ss)

with outputs ``[T][H][Dv]`` and LSEs ``[H][T]``. A +inf LSE counts as -inf; where both
are -inf the prefix output and -inf are the result (no NaN). Tokens at index
``>= prefill_tokens_with_context`` take the suffix (output and LSE) verbatim; a
negative ``prefill_tokens_with_context`` merges every token.
"""

from __future__ import annotations

import numpy as np


def merge_attn_states(prefix_output: np.ndarray, prefix_lse: np.ndarray,
                      suffix_output: np.ndarray, suffix_lse: np.ndarray,
                      prefill_tokens_with_context: int = -1
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(output ``[T][H][Dv]``, output_lse ``[H][T]``), float64."""
    p = np.asarray(prefix_output, dtype=np.float64)
    s = np.asarray(suffix_output, dtype=np.float64)
    T, H, _ = p.shape
    assert s.shape == p.shape, (s.shape, p.shape)
    # [H][T] -> [T][H], the outputs' row order.
    p_lse = np.asarray(prefix_lse, dtype=np.float64).reshape(H, T).T.copy()
    s_lse = np.asarray(suffix_lse, dtype=np.float64).reshape(H, T).T.copy()
    raw_s_lse = s_lse.copy()
    p_lse[np.isposinf(p_lse)] = -np.inf  # +inf counts as -inf
    s_lse[np.isposinf(s_lse)] = -np.inf
    m = np.maximum(p_lse, s_lse)
    empty = np.isneginf(m)  # both sides -inf
    m_safe = np.where(empty, 0.0, m)
    ps = np.exp(p_lse - m_safe)  # exp(-inf) = 0: an empty side weighs nothing
    ss = np.exp(s_lse - m_safe)
    total = np.where(empty, 1.0, ps + ss)
    out = p * (ps / total)[:, :, None] + s * (ss / total)[:, :, None]
    lse = m_safe + np.log(total)
    out[empty] = p[empty]
    lse[empty] = -np.inf
    if prefill_tokens_with_context >= 0:
        tail = slice(prefill_tokens_with_context, None)
        out[tail] = s[tail]
        lse[tail] = raw_s_lse[tail]
    return out, lse.T.copy()
