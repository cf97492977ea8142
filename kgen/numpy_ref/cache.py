"""KV-cache appends and the rows a flash kernel reads back, on NumPy arrays.

Layouts (the kernels' layouts; a leading slot axis is added for the slot kernels):

* f32 cache:   ``k_cache[n_head_kv][max_seq][head_dim]`` float32
* q4 body:     ``k[n_head_kv][max_seq][row_bytes]`` uint8 (see :mod:`.q4`)
* sink shadow: ``k_sink[n_head_kv][SINKMAX][head_dim]`` float16
* window ring: ``k_win[n_head_kv][WMAX][head_dim]`` float16

Every append works in place and mirrors one append kernel. The reader side
(:func:`shadow_source`, :func:`read_key_rows_q4`) mirrors the three-way K/V
selection inside the q4 flash kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .q4 import dequantize_rows, head_dim_of, quantize_rows, row_bytes

WMAX = 256
"""Rows in the fp16 window ring per head; the ring laps here, not at ``win``."""

SINKMAX = 8
"""Rows in the fp16 sink shadow per head."""

SRC_SINK = 0
SRC_WINDOW = 1
SRC_Q4 = 2


# ---------------------------------------------------------------- containers


@dataclass
class Q4Cache:
    """The q4 KV cache of one user (or of all slots, with a leading slot axis).

    Arrays are used in place, so :meth:`slot` views write through.
    """

    k: np.ndarray
    v: np.ndarray
    k_sink: np.ndarray
    v_sink: np.ndarray
    k_win: np.ndarray
    v_win: np.ndarray

    @classmethod
    def empty(
        cls, n_head_kv: int, max_seq: int, head_dim: int, nslots: int | None = None
    ) -> Q4Cache:
        """A cache whose every unwritten row decodes to NaN.

        The body is filled with 0xFF (scale bits 0xFFFF are a binary16 NaN) and
        the shadows with NaN, so reading a row nobody appended poisons the result
        instead of silently contributing zeros.
        """
        lead = () if nslots is None else (nslots,)
        rb = row_bytes(head_dim)

        def body() -> np.ndarray:
            return np.full(lead + (n_head_kv, max_seq, rb), 0xFF, dtype=np.uint8)

        def shadow(rows: int) -> np.ndarray:
            return np.full(lead + (n_head_kv, rows, head_dim), np.nan, dtype=np.float16)

        return cls(body(), body(), shadow(SINKMAX), shadow(SINKMAX), shadow(WMAX), shadow(WMAX))

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.k.shape[-1])

    @property
    def max_seq(self) -> int:
        return self.k.shape[-2]

    @property
    def n_head_kv(self) -> int:
        return self.k.shape[-3]

    def slot(self, u: int) -> Q4Cache:
        """Views of slot ``u`` of a per-slot cache."""
        if self.k.ndim != 4:
            raise ValueError("slot() needs a cache with a leading slot axis")
        return Q4Cache(
            self.k[u], self.v[u], self.k_sink[u], self.v_sink[u], self.k_win[u], self.v_win[u]
        )


def empty_f32_cache(
    n_head_kv: int, max_seq: int, head_dim: int, nslots: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """NaN-filled f32 K and V caches (NaN marks rows never appended)."""
    shape = (() if nslots is None else (nslots,)) + (n_head_kv, max_seq, head_dim)
    return np.full(shape, np.nan, dtype=np.float32), np.full(shape, np.nan, dtype=np.float32)


# ---------------------------------------------------------------- f32 appends


def _check_rows(k_new: np.ndarray, v_new: np.ndarray, ndim: int) -> None:
    if k_new.shape != v_new.shape or k_new.ndim != ndim:
        raise ValueError(f"k_new/v_new must share one {ndim}-D shape, got {k_new.shape}, "
                         f"{v_new.shape}")


def kv_append(
    k_new: np.ndarray, v_new: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos0: int
) -> None:
    """Mirror ``fc_attn_kv_append``: row ``t`` of ``[n][n_head_kv][hd]`` lands at
    ring slot ``(pos0 + t) % max_seq`` of every head."""
    _check_rows(k_new, v_new, 3)
    n = k_new.shape[0]
    max_seq = k_cache.shape[1]
    if pos0 < 0:
        raise ValueError("pos0 must be >= 0 (C's % would give a negative slot)")
    if n > max_seq:
        # Two blocks would race for one slot; the device result is undefined.
        raise ValueError(f"batch of {n} rows laps a ring of {max_seq}")
    slots = (pos0 + np.arange(n)) % max_seq
    k_cache[:, slots, :] = np.swapaxes(k_new, 0, 1)
    v_cache[:, slots, :] = np.swapaxes(v_new, 0, 1)


def kv_append_dev(
    k_new: np.ndarray, v_new: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
    pos: np.ndarray,
) -> None:
    """Mirror ``fc_attn_kv_append_dev``: grid (1, n_head_kv), so only row 0 of
    ``k_new`` lands, at ``pos[0] % max_seq``."""
    kv_append(k_new[:1], v_new[:1], k_cache, v_cache, int(np.asarray(pos).reshape(-1)[0]))


def kv_append_slots(
    k_new: np.ndarray, v_new: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
    pos: np.ndarray,
) -> None:
    """Mirror ``fc_attn_kv_append_slots``: slot ``u``'s row ``[nslots][n_head_kv][hd]``
    lands at ``pos[u] % max_seq`` of its own ring ``[nslots][n_head_kv][max_seq][hd]``."""
    _check_rows(k_new, v_new, 3)
    pos = np.asarray(pos).reshape(-1)
    max_seq = k_cache.shape[2]
    for u in range(k_new.shape[0]):
        if pos[u] < 0:
            raise ValueError("positions must be >= 0")
        p = int(pos[u]) % max_seq
        k_cache[u, :, p, :] = k_new[u]
        v_cache[u, :, p, :] = v_new[u]


# ---------------------------------------------------------------- q4 appends


def _q4_append_rows(
    k_new: np.ndarray, v_new: np.ndarray, cache: Q4Cache, positions: np.ndarray, sink: int,
    win: int,
) -> None:
    """Write rows ``[n][n_head_kv][hd]`` at absolute ``positions`` of one user's cache."""
    if not 0 <= sink <= SINKMAX:
        # The kernel would write past this head's SINKMAX rows into the next head's.
        raise ValueError(f"sink must be in [0, {SINKMAX}], got {sink}")
    if positions.size and (positions.min() < 0 or positions.max() >= cache.max_seq):
        # The q4 body has no ring rule: an out-of-range row is an out-of-bounds write.
        raise IndexError(f"q4 append positions {positions.min()}..{positions.max()} outside "
                         f"[0, {cache.max_seq})")
    k_rows = np.asarray(k_new, dtype=np.float32)
    v_rows = np.asarray(v_new, dtype=np.float32)
    cache.k[:, positions, :] = np.swapaxes(quantize_rows(k_rows), 0, 1)
    cache.v[:, positions, :] = np.swapaxes(quantize_rows(v_rows), 0, 1)
    with np.errstate(over="ignore"):
        k_half = k_rows.astype(np.float16)  # __float2half: round to nearest even
        v_half = v_rows.astype(np.float16)
    if win > 0 and positions.size:
        # Slot = pos % WMAX. Rows WMAX apart in one batch hit the same slot and race
        # on the device; only the newest WMAX positions have a defined slot, and
        # those are the ones written here (the older ones are below every reader's
        # live floor, see prefill_live_floor).
        keep = positions > positions.max() - WMAX
        ring = positions[keep] % WMAX
        cache.k_win[:, ring, :] = np.swapaxes(k_half[keep], 0, 1)
        cache.v_win[:, ring, :] = np.swapaxes(v_half[keep], 0, 1)
    in_sink = positions < sink
    if in_sink.any():
        cache.k_sink[:, positions[in_sink], :] = np.swapaxes(k_half[in_sink], 0, 1)
        cache.v_sink[:, positions[in_sink], :] = np.swapaxes(v_half[in_sink], 0, 1)


def kv_append_q4(
    k_new: np.ndarray, v_new: np.ndarray, cache: Q4Cache, pos0: int, sink: int, win: int
) -> None:
    """Mirror ``fc_attn_kv_append_q4``.

    Row ``t`` of ``[n][n_head_kv][hd]`` is quantized into the body at position
    ``pos0 + t`` (no modulo), mirrored as fp16 into window-ring slot
    ``(pos0 + t) % WMAX`` when ``win > 0``, and into sink row ``pos0 + t`` when
    that position is ``< sink``.
    """
    _check_rows(k_new, v_new, 3)
    _q4_append_rows(k_new, v_new, cache, pos0 + np.arange(k_new.shape[0]), sink, win)


def kv_append_q4_dev(
    k_new: np.ndarray, v_new: np.ndarray, cache: Q4Cache, pos: np.ndarray, sink: int, win: int
) -> None:
    """Mirror ``fc_attn_kv_append_q4_dev``: grid (1, n_head_kv), row 0 at ``pos[0]``."""
    kv_append_q4(k_new[:1], v_new[:1], cache, int(np.asarray(pos).reshape(-1)[0]), sink, win)


def kv_append_slots_q4(
    k_new: np.ndarray, v_new: np.ndarray, cache: Q4Cache, pos: np.ndarray, sink: int, win: int
) -> None:
    """Mirror ``fc_attn_kv_append_slots_q4``: slot ``u``'s row ``[nslots][n_head_kv][hd]``
    goes to position ``pos[u]`` of slot ``u``'s body and shadows (per-slot cache)."""
    _check_rows(k_new, v_new, 3)
    pos = np.asarray(pos).reshape(-1)
    for u in range(k_new.shape[0]):
        _q4_append_rows(k_new[u][None], v_new[u][None], cache.slot(u),
                        np.array([int(pos[u])]), sink, win)


# ---------------------------------------------------------------- q4 readers


def is_fp16(s: int, cur_pos: int, sink: int, win: int) -> bool:
    """Mirror ``fc_kvq4_is_fp16``: key ``s`` comes from an fp16 shadow (no live floor)."""
    return s < sink or (win > 0 and s > cur_pos - win)


def prefill_live_floor(pos0: int, n: int) -> int:
    """``win_live_lo`` of the q4 prefill kernels for a batch of ``n`` rows at ``pos0``.

    All ``n`` rows are appended before any query reads, so ring slot
    ``p % WMAX`` still holds ``p`` only while ``p > (pos0 + n - 1) - WMAX``.
    """
    return pos0 + n - 1 - WMAX


def shadow_source(
    kp: np.ndarray | int, cur_pos: int, sink: int, win: int, win_live_lo: int | None = None
) -> np.ndarray:
    """Where the q4 flash kernels read key/value position ``kp`` from, for a query at
    ``cur_pos``: ``SRC_SINK``, ``SRC_WINDOW`` or ``SRC_Q4``.

    Sink shadow if ``kp < sink``; else the window ring if ``win > 0`` and
    ``kp > cur_pos - win`` (and, prefill only, ``kp > win_live_lo``); else the
    q4 body. Pass ``win_live_lo=None`` for the decode kernels, which have no floor.
    """
    kp = np.asarray(kp)
    in_win = (win > 0) & (kp > cur_pos - win)
    if win_live_lo is not None:
        in_win &= kp > win_live_lo
    return np.where(kp < sink, SRC_SINK, np.where(in_win, SRC_WINDOW, SRC_Q4)).astype(np.int8)


def _assemble_rows(
    body_f32: np.ndarray, sink_rows: np.ndarray, win_rows: np.ndarray, cur_pos: int, sink: int,
    win: int, n_keys: int, win_live_lo: int | None,
) -> np.ndarray:
    """Pick per key between dequantized body rows and the widened fp16 shadows."""
    if not 0 <= sink <= SINKMAX:
        raise ValueError(f"sink must be in [0, {SINKMAX}], got {sink}")
    kp = np.arange(n_keys)
    src = shadow_source(kp, cur_pos, sink, win, win_live_lo)
    out = np.array(body_f32[..., :n_keys, :], dtype=np.float32, copy=True)
    s = src == SRC_SINK
    out[..., s, :] = sink_rows[..., kp[s], :].astype(np.float32)  # __half2float is exact
    w = src == SRC_WINDOW
    out[..., w, :] = win_rows[..., kp[w] % WMAX, :].astype(np.float32)
    return out


def read_key_rows_q4(
    body: np.ndarray, sink_rows: np.ndarray, win_rows: np.ndarray, cur_pos: int, sink: int,
    win: int, n_keys: int | None = None, win_live_lo: int | None = None,
) -> np.ndarray:
    """Float32 K (or V) rows a q4 flash kernel sees for a query at ``cur_pos``.

    ``body`` is ``uint8[n_head_kv][max_seq][row_bytes]``, ``sink_rows`` /
    ``win_rows`` the matching fp16 shadows. Returns ``float32[n_head_kv][n_keys][hd]``
    for key positions ``0 .. n_keys-1`` (default ``cur_pos + 1``), selected as in
    the staging loop of ``fc_attn_flash_prefill_q4`` (with ``win_live_lo``) or
    ``fc_attn_flash_decode_q4`` (``win_live_lo=None``). V rows use the same rule.
    Whether a key is attended at all is a separate question (the tile predicate).
    """
    n_keys = cur_pos + 1 if n_keys is None else n_keys
    body_f32 = dequantize_rows(body[..., :n_keys, :])
    return _assemble_rows(body_f32, sink_rows, win_rows, cur_pos, sink, win, n_keys, win_live_lo)


def read_kv_rows_q4(
    cache: Q4Cache, cur_pos: int, sink: int, win: int, n_keys: int | None = None,
    win_live_lo: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`read_key_rows_q4` for both K and V of one user's cache."""
    k = read_key_rows_q4(cache.k, cache.k_sink, cache.k_win, cur_pos, sink, win, n_keys,
                         win_live_lo)
    v = read_key_rows_q4(cache.v, cache.v_sink, cache.v_win, cur_pos, sink, win, n_keys,
                         win_live_lo)
    return k, v
