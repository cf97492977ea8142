"""Causal GQA attention as the flash kernels compute it, in float64.

The inputs are the float32 values a kernel sees (q, the K/V rows it stages or
dequantizes, the float32 ``scale`` argument); everything after that is float64,
so the result is the exact softmax over the kernel's *attended key set*. That
set is where the kernels differ from the textbook sliding window: the window
predicate ``fc_attn_tile_in_window`` keeps or skips whole 16-key tiles, so a
key outside ``[0, attn_sink) U [cur_pos - attn_win + 1, cur_pos]`` is still
attended when its tile touches that set (see :func:`attended_keys`).

GQA: global head ``qh`` reads kv head ``qh // kv_groups``. Partials for decode
are laid out as the split kernels write them: ``m[qh * n_splits + split]``,
``l[...]`` likewise, ``acc[(qh * n_splits + split) * head_dim + d]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kgen.ir.axes import KEYS
from kgen.runtime.plan import decode_plan as _plan

from .cache import HostCache, read_kv_rows

TILE_KEYS = KEYS["tile_keys"].default
"""Keys per tile (the spec's default; kernels pass their own ``tile``)."""

DOT_LANES = KEYS["dot_lanes"].default
"""Threads cooperating on one q.k dot (the spec's default)."""

MAX_GROUPS = KEYS["max_groups"].default
"""Largest ``kv_groups`` a kernel accumulates (the spec's default; ``max_groups``)."""

RowsFn = Callable[[int, int], tuple[np.ndarray, np.ndarray]]


# ---------------------------------------------------------------- small utilities


def qz_split(qg: np.ndarray, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Mirror ``fc_attn_qz_split``: per (position, head) the joint projection holds
    ``[q head_dim | z head_dim]``; return ``(q, z)``.

    ``qg`` is ``[..., 2*head_dim]`` (e.g. ``[n][n_head][2*head_dim]``) and the
    outputs are ``[..., head_dim]``; a flat ``qg`` gives flat outputs.
    """
    qg = np.asarray(qg)
    if qg.size % (2 * head_dim):
        raise ValueError(f"qg size {qg.size} is not a multiple of 2*head_dim={2 * head_dim}")
    pairs = qg.reshape(-1, 2 * head_dim)
    q = pairs[:, :head_dim].copy()
    z = pairs[:, head_dim:].copy()
    if qg.ndim > 1 and qg.shape[-1] == 2 * head_dim:
        shape = qg.shape[:-1] + (head_dim,)
        return q.reshape(shape), z.reshape(shape)
    return q.reshape(-1), z.reshape(-1)


def keys_scored_per_tile(head_dim: int, tile: int = TILE_KEYS, lanes: int = DOT_LANES) -> int:
    """How many keys of a 16-key tile the QK dot actually scores with a block of
    ``head_dim`` threads.

    The dot assigns key ``ky = tid / 16``, so a block of fewer than
    ``TILE_KEYS * DOT_LANES`` (256) threads never writes the scores of keys
    ``ky >= head_dim / 16``; the softmax fold then reads stale shared memory for
    them. The kernels are only well defined when this returns ``TILE_KEYS``.
    """
    return min(tile, head_dim // lanes)


def tile_in_window(j0: int, tk: int, cur_pos: int, attn_sink: int, attn_win: int) -> bool:
    """Mirror ``fc_attn_tile_in_window``: is tile ``[j0, j0 + tk)`` processed?"""
    if attn_win <= 0 or j0 < attn_sink:
        return True
    win_lo = max(cur_pos - attn_win + 1, 0)
    return j0 + tk > win_lo and j0 <= cur_pos


def attended_keys(
    cur_pos: int, keys: int | tuple[int, int], attn_sink: int, attn_win: int,
    tile: int = TILE_KEYS,
) -> np.ndarray:
    """Boolean mask over key positions ``0 .. k_hi-1`` of the keys a kernel attends.

    ``keys`` is ``seq_len`` (prefill: tiles from 0 over ``[0, seq_len)``) or a
    decode split's ``(k_lo, k_hi)`` (tiles from ``k_lo``; keys below ``k_lo`` are
    False). Tiles are ``tile`` keys long, the last one truncated at ``k_hi``,
    and each is kept or skipped as a whole by :func:`tile_in_window`.
    """
    k_lo, k_hi = (0, keys) if isinstance(keys, int | np.integer) else keys
    mask = np.zeros(max(int(k_hi), 0), dtype=bool)
    for j0 in range(k_lo, k_hi, tile):
        tk = min(tile, k_hi - j0)
        if tile_in_window(j0, tk, cur_pos, attn_sink, attn_win):
            mask[j0:j0 + tk] = True
    return mask


def nominal_window_keys(cur_pos: int, seq_len: int, attn_sink: int, attn_win: int) -> np.ndarray:
    """Per-key set the kernels' documentation describes (not what they compute):
    all keys when ``attn_win <= 0``, else ``[0, attn_sink) U [cur_pos - attn_win + 1, cur_pos]``."""
    kp = np.arange(seq_len)
    if attn_win <= 0:
        return kp <= cur_pos
    return (kp < attn_sink) | ((kp > cur_pos - attn_win) & (kp <= cur_pos))


def decode_plan(seq_len: int, kps: int, cap: int, tile: int = TILE_KEYS) -> tuple[int, int]:
    """The host plan (:func:`kgen.runtime.plan.decode_plan`, the one formula the
    device plan mirrors) as ``(n_splits, split_len)``."""
    p = _plan(seq_len, kps, cap, tile)
    return p.n_splits, p.split_len


def split_bounds(split: int, split_len: int, seq_len: int) -> tuple[int, int]:
    """Key range ``[k_lo, k_hi)`` of one decode split."""
    k_lo = split * split_len
    return k_lo, min(k_lo + split_len, seq_len)


# ---------------------------------------------------------------- softmax core


def _check_gqa(n_head: int, n_head_kv: int, kv_groups: int, max_groups: int) -> None:
    if not 1 <= kv_groups <= max_groups:
        # Groups past max_groups are never accumulated nor written by the kernels.
        raise ValueError(f"kv_groups must be in [1, {max_groups}], got {kv_groups}")
    if n_head != n_head_kv * kv_groups:
        raise ValueError(f"n_head={n_head} != n_head_kv={n_head_kv} * kv_groups={kv_groups}")


def _scale64(scale: float) -> float:
    # The kernels take `float scale`: round to float32 first, as the launch does.
    return float(np.float32(scale))


def exact_keys(cur_pos: int, keys: int | tuple[int, int], seq_len: int, attn_sink: int,
               window: tuple[int, int]) -> np.ndarray:
    """Boolean mask over key positions ``0 .. k_hi-1`` a key-exact window
    (``window = exact``) attends: keys of ``keys`` (``seq_len`` or a split's
    ``(k_lo, k_hi)``) in ``[cur_pos - left, cur_pos + right]`` clamped to
    ``[0, seq_len)``, or in the sink prefix ``[0, attn_sink)``. Tiles only skip
    work here: every visible key's tile is kept, the rest are masked to -inf."""
    k_lo, k_hi = (0, keys) if isinstance(keys, int | np.integer) else keys
    left, right = window
    lo = max(cur_pos - left, 0)
    hi = min(cur_pos + right, seq_len - 1)
    kp = np.arange(max(int(k_hi), 0))
    return (kp >= k_lo) & ((kp < attn_sink) | ((kp >= lo) & (kp <= hi)))


def key_mask(cur_pos: int, keys, seq_len: int, attn_sink: int, attn_win: int, tile: int,
             window: tuple[int, int] | None) -> np.ndarray:
    """The attended keys: key-exact when ``window`` is given, else whole tiles."""
    if window is not None:
        return exact_keys(cur_pos, keys, seq_len, attn_sink, window)
    return attended_keys(cur_pos, keys, attn_sink, attn_win, tile)


def soft_cap(s: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(s / cap)``; a cap of 0 is off."""
    if cap <= 0:
        return s
    cap = float(np.float32(cap))
    return cap * np.tanh(s / cap)


def _partial(
    qg: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float,
    softcap: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Online-softmax state after folding the masked keys, for a group of heads.

    ``qg [G][hd]``, ``k/v [L][hd]`` (at least ``len(mask)`` rows), ``mask [L]``.
    Returns float64 ``m [G]``, ``l [G]``, ``acc [G][hd]``; with no key at all the
    kernel's initial state ``(-inf, 0, 0)``.
    """
    g, hd = qg.shape
    idx = np.flatnonzero(mask)
    if idx.size == 0:
        return np.full(g, -np.inf), np.zeros(g), np.zeros((g, hd))
    # Only masked-in rows are touched: unread rows may hold NaN poison.
    kk = k[idx].astype(np.float64)
    vv = v[idx].astype(np.float64)
    s = soft_cap((qg.astype(np.float64) @ kk.T) * scale, softcap)
    m = s.max(axis=1)
    p = np.exp(s - m[:, None])
    return m, p.sum(axis=1), p @ vv


def _group_state(
    q_heads: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, mask: np.ndarray,
    kv_groups: int, scale: float, softcap: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_partial` for every kv head; ``q_heads [n_head][hd]``, rows ``[n_kv][L][hd]``."""
    n_head, hd = q_heads.shape
    m = np.empty(n_head)
    lsum = np.empty(n_head)
    acc = np.empty((n_head, hd))
    for kvh in range(k_rows.shape[0]):
        hs = slice(kvh * kv_groups, (kvh + 1) * kv_groups)
        m[hs], lsum[hs], acc[hs] = _partial(q_heads[hs], k_rows[kvh], v_rows[kvh], mask, scale,
                                            softcap)
    return m, lsum, acc


# ---------------------------------------------------------------- prefill


def prefill_attention_rows(
    q: np.ndarray, rows_fn: RowsFn, kv_groups: int, pos0: int, attn_sink: int, attn_win: int,
    scale: float, tile: int = TILE_KEYS, max_groups: int = MAX_GROUPS, *,
    window: tuple[int, int] | None = None, softcap: float = 0.0, full: bool = False,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Causal GQA prefill over caller-supplied K/V rows; float64 ``[n][n_head][hd]``.

    Options of the newer kernels: ``window`` = (left, right) for a key-exact
    window, ``softcap``, ``full`` (mask = full: every row sees all ``pos0 + n``
    keys) and ``sinks`` (one logit per q head joining each denominator).

    Query ``t`` (position ``cur_pos = pos0 + t``) attends keys ``[0, cur_pos]``
    kept by the tile predicate (``tile`` keys a tile). ``rows_fn(t, cur_pos)``
    returns the float32 ``(K, V)`` rows ``[n_head_kv][>= cur_pos + 1][hd]`` that
    query sees.
    """
    q = np.asarray(q, dtype=np.float32)
    n, n_head, hd = q.shape
    scale = _scale64(scale)
    out = np.empty((n, n_head, hd))
    for t in range(n):
        cur_pos = pos0 + t
        seq_len = pos0 + n if full else cur_pos + 1
        k_rows, v_rows = rows_fn(t, seq_len - 1)
        _check_gqa(n_head, k_rows.shape[0], kv_groups, max_groups)
        mask = key_mask(cur_pos, seq_len, seq_len, attn_sink, attn_win, tile, window)
        m, lsum, acc = _group_state(q[t], k_rows, v_rows, mask, kv_groups, scale, softcap)
        if sinks is not None:  # rescale to max(m, sink): the sink adds to l, not to acc
            top = np.maximum(m, sinks)
            w = np.exp(m - top)
            out[t] = acc * w[:, None] / (lsum * w + np.exp(sinks - top))[:, None]
        else:
            out[t] = acc / lsum[:, None]
    return out


def prefill_attention(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, kv_groups: int, pos0: int,
    attn_sink: int, attn_win: int, scale: float, tile: int = TILE_KEYS,
    max_groups: int = MAX_GROUPS, **options,
) -> np.ndarray:
    """Prefill over float32 K/V rows ``[n_head_kv][max_seq][hd]`` (an f32 cache as
    it is), in float64. Key ``kp`` is row ``kp`` (no ring wrap), so
    ``pos0 + n <= max_seq`` is required."""
    if pos0 < 0 or pos0 + q.shape[0] > k_cache.shape[1]:
        raise ValueError("prefill needs 0 <= pos0 and pos0 + n <= max_seq (no ring wrap)")
    return prefill_attention_rows(
        q, lambda _t, _p: (k_cache, v_cache), kv_groups, pos0, attn_sink, attn_win, scale,
        tile, max_groups, **options)


def prefill_attention_cache(
    q: np.ndarray, cache: HostCache, kv_groups: int, pos0: int, sink: int, win: int,
    attn_sink: int, attn_win: int, scale: float, live_floor: int | None = None,
    tile: int = TILE_KEYS, max_groups: int = MAX_GROUPS, k_round=None, **options,
) -> np.ndarray:
    """Prefill over a cache of any format, in float64: each query sees the rows its
    kernel reads (body, or for a shadowed format the sink/window shadows, with the
    ring's batch ``live_floor`` where the kernel has one). ``k_round`` narrows K as
    a staged tile does (an fp16 K tile)."""
    n = np.asarray(q).shape[0]
    if pos0 < 0 or pos0 + n > cache.max_seq:
        raise ValueError("prefill needs 0 <= pos0 and pos0 + n <= max_seq")

    def rows(t: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        # The shadow choice depends on the query's own position, the keys on ``last``.
        kk, vv = read_kv_rows(cache, pos0 + t, sink, win, last + 1, live_floor)
        return (k_round(kk) if k_round else kk), vv

    return prefill_attention_rows(q, rows, kv_groups, pos0, attn_sink, attn_win, scale, tile,
                                  max_groups, **options)


# ---------------------------------------------------------------- decode


def _split_states(
    q: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, kv_groups: int, seq_len: int,
    n_splits: int, split_len: int, attn_sink: int, attn_win: int, scale: float,
    tile: int = TILE_KEYS, max_groups: int = MAX_GROUPS, *,
    window: tuple[int, int] | None = None, softcap: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-split partials: ``m``, ``l`` ``[n_head][n_splits]``; ``acc [n_head][n_splits][hd]``."""
    q = np.asarray(q, dtype=np.float32)
    n_head, hd = q.shape
    _check_gqa(n_head, k_rows.shape[0], kv_groups, max_groups)
    if k_rows.shape[1] < seq_len or v_rows.shape[1] < seq_len:
        raise ValueError(f"need at least seq_len={seq_len} K/V rows per head")
    scale = _scale64(scale)
    cur_pos = seq_len - 1
    m = np.empty((n_head, n_splits))
    lsum = np.empty((n_head, n_splits))
    acc = np.empty((n_head, n_splits, hd))
    for split in range(n_splits):
        # A split past seq_len runs no tile, and a split whose tiles are all
        # outside the window skips every one: both leave the initial state.
        mask = key_mask(cur_pos, split_bounds(split, split_len, seq_len), seq_len, attn_sink,
                        attn_win, tile, window)
        m[:, split], lsum[:, split], acc[:, split] = _group_state(
            q, k_rows, v_rows, mask, kv_groups, scale, softcap)
    return m, lsum, acc


def decode_partials(
    q: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, kv_groups: int, seq_len: int,
    n_splits: int, split_len: int, attn_sink: int, attn_win: int, scale: float,
    tile: int = TILE_KEYS, max_groups: int = MAX_GROUPS, **options,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (m, l, acc) scratch the decode split kernels write, in float64.

    ``k_rows``/``v_rows`` are the float32 rows the kernel reads for the query at
    ``seq_len - 1`` (an f32 cache as it is; other formats: :func:`read_kv_rows`,
    no live floor). ``q`` is ``[n_head][hd]``. Returns flat ``m``, ``l`` of length
    ``n_head * n_splits`` and ``acc`` of length ``n_head * n_splits * hd`` in the
    kernels' layout.
    """
    m, lsum, acc = _split_states(q, k_rows, v_rows, kv_groups, seq_len, n_splits, split_len,
                                 attn_sink, attn_win, scale, tile, max_groups, **options)
    return m.reshape(-1), lsum.reshape(-1), acc.reshape(-1)


def combine(m: np.ndarray, l: np.ndarray, acc: np.ndarray, n_splits: int,  # noqa: E741
            sinks: np.ndarray | None = None) -> np.ndarray:
    """The combine kernels in float64.

    Per head: ``M = max(m)``, ``w_s = exp(m_s - M)`` (0 for an empty split),
    ``out = sum(acc_s * w_s) / sum(l_s * w_s)``. Heads are ``m.size // n_splits``
    (for the slots layout that is ``nslots * n_head``); returns ``[heads][hd]``.
    """
    m = np.asarray(m, dtype=np.float64).reshape(-1, n_splits)
    lsum = np.asarray(l, dtype=np.float64).reshape(-1, n_splits)
    acc = np.asarray(acc, dtype=np.float64).reshape(m.shape[0], n_splits, -1)
    big_m = m.max(axis=1, keepdims=True)
    if sinks is not None:  # one logit per head: joins the denominator only
        sinks = np.asarray(sinks, dtype=np.float64).reshape(-1, 1)
        big_m = np.maximum(big_m, sinks)
    with np.errstate(invalid="ignore"):
        w = np.exp(m - big_m)
    big_l = (lsum * w).sum(axis=1)
    if sinks is not None:
        big_l = big_l + np.exp(sinks - big_m)[:, 0]
    o = (acc * w[:, :, None]).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return o / big_l[:, None]


def decode_attention(
    q: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, kv_groups: int, seq_len: int,
    kps: int, cap: int, attn_sink: int, attn_win: int, scale: float,
    tile: int = TILE_KEYS, max_groups: int = MAX_GROUPS, sinks=None, **options,
) -> np.ndarray:
    """Split decode with the plan followed by the combine; float64 ``[n_head][hd]``.
    Equals single-query attention over the attended keys."""
    n_splits, split_len = decode_plan(seq_len, kps, cap, tile)
    m, lsum, acc = decode_partials(q, k_rows, v_rows, kv_groups, seq_len, n_splits, split_len,
                                   attn_sink, attn_win, scale, tile, max_groups, **options)
    return combine(m, lsum, acc, n_splits, sinks).reshape(np.shape(q))


# ---------------------------------------------------------------- multi-user decode


SlotRows = np.ndarray | Sequence[tuple[np.ndarray, np.ndarray]] | Callable[
    [int], tuple[np.ndarray, np.ndarray]]


def _slot_rows(k_rows: SlotRows, v_rows: np.ndarray | None, u: int
               ) -> tuple[np.ndarray, np.ndarray]:
    if callable(k_rows):
        return k_rows(u)
    if v_rows is None:
        return k_rows[u]
    return k_rows[u], v_rows[u]


def decode_partials_slots(
    q: np.ndarray, k_rows: SlotRows, v_rows: np.ndarray | None, pos: np.ndarray, kv_groups: int,
    kps: int, cap: int, attn_sink: int, attn_win: int, scale: float,
    launch_splits: int | None = None, tile: int = TILE_KEYS, max_groups: int = MAX_GROUPS,
    **options,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Partials of the slots decode kernels, in float64.

    ``q [nslots][n_head][hd]``; user ``u`` decodes at ``pos[u]`` with its own
    plan. K/V rows per slot come from arrays ``[nslots][n_head_kv][max_seq][hd]``,
    or ``k_rows`` is a callable ``u -> (K, V)`` / a sequence of ``(K, V)`` with
    ``v_rows=None`` (``read_kv_rows(cache.slot(u), pos[u], sink, win)``). The
    stride is the launch width (default: the largest plan); splits past a user's
    plan are empty. Layout: index ``(u * n_head + qh) * launch_splits + split``.
    Returns ``(m, l, acc, launch_splits)``.
    """
    q = np.asarray(q, dtype=np.float32)
    nslots, n_head, hd = q.shape
    pos = np.asarray(pos).reshape(-1)
    plans = [decode_plan(int(pos[u]) + 1, kps, cap, tile) for u in range(nslots)]
    width = max(p[0] for p in plans) if launch_splits is None else launch_splits
    if width < max(p[0] for p in plans):
        raise ValueError(f"launch_splits={width} is narrower than a user's plan")
    m = np.full((nslots, n_head, width), -np.inf)
    lsum = np.zeros((nslots, n_head, width))
    acc = np.zeros((nslots, n_head, width, hd))
    for u, (n_splits, split_len) in enumerate(plans):
        k_u, v_u = _slot_rows(k_rows, v_rows, u)
        st = _split_states(q[u], k_u, v_u, kv_groups, int(pos[u]) + 1, n_splits, split_len,
                           attn_sink, attn_win, scale, tile, max_groups, **options)
        m[u, :, :n_splits], lsum[u, :, :n_splits], acc[u, :, :n_splits] = st
    return m.reshape(-1), lsum.reshape(-1), acc.reshape(-1), width


def decode_attention_slots(
    q: np.ndarray, k_rows: SlotRows, v_rows: np.ndarray | None, pos: np.ndarray, kv_groups: int,
    kps: int, cap: int, attn_sink: int, attn_win: int, scale: float,
    launch_splits: int | None = None, tile: int = TILE_KEYS, max_groups: int = MAX_GROUPS,
) -> np.ndarray:
    """Slot partials merged by the combine over ``nslots * n_head`` heads;
    float64 ``[nslots][n_head][hd]``."""
    m, lsum, acc, width = decode_partials_slots(q, k_rows, v_rows, pos, kv_groups, kps, cap,
                                                attn_sink, attn_win, scale, launch_splits,
                                                tile, max_groups)
    return combine(m, lsum, acc, width).reshape(np.shape(q))
