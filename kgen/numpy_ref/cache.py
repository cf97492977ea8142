"""KV-cache appends and the rows a flash kernel reads back, on NumPy arrays, for
any KV format (``kgen.formats``), or a pair of them (K rows in one format, V rows in
another: ``kgen.formats.KvPair``): each role's format model quantizes and dequantizes
its rows; this module places them.

Layouts (the kernels'; a leading slot axis is added for the slot kernels):

* body:        ``k[n_head_kv][max_seq][row_width]`` in the format's dtype
* sink shadow: ``k_sink[n_head_kv][sink_rows][head_dim]`` float16 (shadowed formats)
* window ring: ``k_win[n_head_kv][ring_rows][head_dim]`` float16 (shadowed formats)

Every append works in place and mirrors the append kernels. The reader side
(:func:`shadow_source`, :func:`read_kv_rows`) mirrors the three-way K/V
selection inside the flash kernels of a shadowed format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kgen.formats import KvFormat, KvPair, as_pair
from kgen.formats.base import ROLES

SRC_SINK = 0
SRC_WINDOW = 1
SRC_BODY = 2


@dataclass
class HostCache:
    """The KV cache of one user (or of all slots, with a leading slot axis): K rows in
    ``fmt``'s layout, V rows in ``v_fmt``'s (None: ``fmt``'s too). Arrays are used in
    place, so :meth:`slot` views write through."""

    fmt: KvFormat
    k: np.ndarray
    v: np.ndarray
    shadows: dict[str, np.ndarray] = field(default_factory=dict)  # in argument order
    k_scale: float = 1.0  # per-tensor scales of a format with tensor_scales
    v_scale: float = 1.0
    v_fmt: KvFormat | None = None

    @property
    def pair(self) -> KvPair:
        return KvPair(self.fmt, self.v_fmt or self.fmt)

    @classmethod
    def empty(cls, fmt: KvFormat | KvPair | str, n_head_kv: int, max_seq: int, head_dim: int,
              ring_rows: int = 0, sink_rows: int = 0, nslots: int | None = None,
              k_scale: float = 1.0, v_scale: float = 1.0) -> HostCache:
        """A cache whose every unwritten row decodes to NaN, so reading a row nobody
        appended poisons the result instead of silently contributing a value. ``fmt``:
        a format (both roles), or a pair (a mixed cache)."""
        pair = as_pair(fmt)
        if pair.shadows and (ring_rows < 1 or sink_rows < 1):
            raise ValueError(f"{pair.name} keeps fp16 shadows: give the kernels' ring_rows "
                             f"and sink_rows (got {ring_rows}, {sink_rows})")
        lead = () if nslots is None else (nslots,)
        rows = {"sink_rows": sink_rows, "ring_rows": ring_rows}
        shadows = {s.name: np.full(lead + (n_head_kv, rows[s.rows_key], head_dim), np.nan,
                                   dtype=np.float16) for s in pair.shadow_buffers()}
        k, v = (np.full(lead + (n_head_kv, max_seq, f.row_width(head_dim)), f.poison(),
                        dtype=f.dtype) for f in (pair.k, pair.v))
        return cls(pair.k, k, v, shadows, k_scale, v_scale, pair.v if pair.mixed else None)

    @property
    def arrays(self) -> list[np.ndarray]:
        """Body and shadows in the kernels' argument order."""
        return [self.k, self.v, *self.shadows.values()]

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1] // self.fmt.block_width * self.fmt.block

    @property
    def max_seq(self) -> int:
        return self.k.shape[-2]

    @property
    def n_head_kv(self) -> int:
        return self.k.shape[-3]

    @property
    def ring_rows(self) -> int:
        wins = [a for n, a in self.shadows.items() if n.endswith("_win")]
        return wins[0].shape[-2] if wins else 0

    @property
    def sink_rows(self) -> int:
        sinks = [a for n, a in self.shadows.items() if n.endswith("_sink")]
        return sinks[0].shape[-2] if sinks else 0

    def slot(self, u: int) -> HostCache:
        """Views of slot ``u`` of a per-slot cache."""
        if self.k.ndim != 4:
            raise ValueError("slot() needs a cache with a leading slot axis")
        return HostCache(self.fmt, self.k[u], self.v[u],
                         {n: a[u] for n, a in self.shadows.items()}, self.k_scale, self.v_scale,
                         self.v_fmt)


# ---------------------------------------------------------------- appends


def _check_rows(k_new: np.ndarray, v_new: np.ndarray, ndim: int) -> None:
    if k_new.shape != v_new.shape or k_new.ndim != ndim:
        raise ValueError(f"k_new/v_new must share one {ndim}-D shape, got {k_new.shape}, "
                         f"{v_new.shape}")


def append_rows(k_new: np.ndarray, v_new: np.ndarray, cache: HostCache, positions: np.ndarray,
                sink: int = 0, win: int = 0) -> None:
    """Write rows ``[n][n_head_kv][hd]`` at absolute ``positions`` of one user's cache:
    the body at ``pos % max_seq`` (or ``pos`` where a role's format does not wrap)
    and, for each role of a shadowed format, fp16 mirrors in the window ring and the
    sink rows."""
    _check_rows(k_new, v_new, 3)
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    fmt, max_seq = cache.pair, cache.max_seq
    if positions.size and positions.min() < 0:
        raise ValueError("positions must be >= 0 (C's % would give a negative row)")
    if fmt.append_wraps:
        if positions.size > max_seq:  # two blocks would race for one row
            raise ValueError(f"batch of {positions.size} rows laps a ring of {max_seq}")
        rows = positions % max_seq
    else:
        if positions.size and positions.max() >= max_seq:
            raise IndexError(f"{fmt.name} append positions {positions.min()}.."
                             f"{positions.max()} outside [0, {max_seq})")
        rows = positions
    if fmt.shadows and not 0 <= sink <= cache.sink_rows:
        # The kernel would write past this head's sink rows into the next head's.
        # (Checked before any write, so a rejected append leaves the cache as it was.)
        raise ValueError(f"sink must be in [0, {cache.sink_rows}], got {sink}")
    kx = np.asarray(k_new, dtype=np.float32)
    vx = np.asarray(v_new, dtype=np.float32)
    cache.k[:, rows, :] = np.swapaxes(fmt.k.quantize_rows(kx, cache.k_scale), 0, 1)
    cache.v[:, rows, :] = np.swapaxes(fmt.v.quantize_rows(vx, cache.v_scale), 0, 1)
    if not fmt.shadows:
        return
    ring = cache.ring_rows
    with np.errstate(over="ignore"):
        half = {"k": kx.astype(np.float16), "v": vx.astype(np.float16)}  # __float2half
    roles = [r for r in ROLES if fmt.of(r).shadows]
    if win > 0 and positions.size:
        # Slot = pos % ring. Rows a ring apart in one batch hit the same slot and race
        # on the device; only the newest ring_rows positions have a defined slot, and
        # those are the ones written here (the older ones are below every reader's
        # live floor, see prefill_live_floor).
        keep = positions > positions.max() - ring
        slots = positions[keep] % ring
        for r in roles:
            cache.shadows[f"{r}_win"][:, slots, :] = np.swapaxes(half[r][keep], 0, 1)
    in_sink = positions < sink
    if in_sink.any():
        for r in roles:
            cache.shadows[f"{r}_sink"][:, positions[in_sink], :] = \
                np.swapaxes(half[r][in_sink], 0, 1)


def append(k_new, v_new, cache: HostCache, pos0: int, sink: int = 0, win: int = 0) -> None:
    """The host-position append: row ``t`` at position ``pos0 + t``."""
    append_rows(k_new, v_new, cache, pos0 + np.arange(np.shape(k_new)[0]), sink, win)


def append_dev(k_new, v_new, cache: HostCache, pos, sink: int = 0, win: int = 0) -> None:
    """The device-position append: grid (1, n_head_kv), only row 0 lands, at ``pos[0]``."""
    append(k_new[:1], v_new[:1], cache, int(np.asarray(pos).reshape(-1)[0]), sink, win)


def append_slots(k_new, v_new, cache: HostCache, pos, sink: int = 0, win: int = 0) -> None:
    """Slot ``u``'s row of ``[nslots][n_head_kv][hd]`` at ``pos[u]`` of its own cache."""
    _check_rows(k_new, v_new, 3)
    pos = np.asarray(pos).reshape(-1)
    for u in range(k_new.shape[0]):
        append_rows(k_new[u][None], v_new[u][None], cache.slot(u), np.array([int(pos[u])]),
                    sink, win)


def fill(cache: HostCache, kx: np.ndarray, vx: np.ndarray, pos0: int, upto: int, sink: int,
         win: int) -> None:
    """Positions ``[0, upto)`` from rows ``kx/vx [upto][n_head_kv][hd]`` as the append
    kernels leave them: the history ``[0, pos0)`` in race-free batches, then the batch."""
    step = cache.ring_rows if cache.pair.shadows and win > 0 else cache.max_seq
    for lo in range(0, pos0, step):
        hi = min(lo + step, pos0)
        append(kx[lo:hi], vx[lo:hi], cache, lo, sink, win)
    append(kx[pos0:upto], vx[pos0:upto], cache, pos0, sink, win)


# ---------------------------------------------------------------- readers


def prefill_live_floor(pos0: int, n: int, ring_rows: int) -> int:
    """``win_live_lo`` of a batch-floor prefill for ``n`` rows at ``pos0``: all rows
    are appended before any query reads, so ring slot ``p % ring_rows`` still holds
    ``p`` only while ``p > (pos0 + n - 1) - ring_rows``."""
    return pos0 + n - 1 - ring_rows


def shadow_source(kp, cur_pos: int, sink: int, win: int,
                  win_live_lo: int | None = None) -> np.ndarray:
    """Where a shadowed format's flash kernels read key/value position ``kp`` from, for
    a query at ``cur_pos``: ``SRC_SINK``, ``SRC_WINDOW`` or ``SRC_BODY``. Sink shadow if
    ``kp < sink``; else the window ring if ``win > 0`` and ``kp > cur_pos - win`` (and,
    with the batch floor, ``kp > win_live_lo``); else the body."""
    kp = np.asarray(kp)
    in_win = (win > 0) & (kp > cur_pos - win)
    if win_live_lo is not None:
        in_win &= kp > win_live_lo
    return np.where(kp < sink, SRC_SINK, np.where(in_win, SRC_WINDOW, SRC_BODY)).astype(np.int8)


def _rows(cache: HostCache, which: str, cur_pos: int, sink: int, win: int, n_keys: int,
          win_live_lo: int | None) -> np.ndarray:
    body = getattr(cache, which)
    scale = cache.k_scale if which == "k" else cache.v_scale
    fmt = cache.pair.of(which)
    out = np.array(fmt.dequantize_rows(body[..., :n_keys, :], scale), dtype=np.float32)
    if not fmt.shadows:
        return out
    kp = np.arange(n_keys)
    src = shadow_source(kp, cur_pos, sink, win, win_live_lo)
    s, w = src == SRC_SINK, src == SRC_WINDOW
    out[..., s, :] = cache.shadows[f"{which}_sink"][..., kp[s], :].astype(np.float32)
    out[..., w, :] = cache.shadows[f"{which}_win"][..., kp[w] % cache.ring_rows, :] \
        .astype(np.float32)  # __half2float is exact
    return out


def read_kv_rows(cache: HostCache, cur_pos: int, sink: int = 0, win: int = 0,
                 n_keys: int | None = None, win_live_lo: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Float32 K and V rows ``[n_head_kv][n_keys][hd]`` a flash kernel sees for a
    query at ``cur_pos`` (keys ``0 .. n_keys-1``, default ``cur_pos + 1``). Whether a
    key is attended at all is the tile predicate's question, not this one's."""
    n_keys = cur_pos + 1 if n_keys is None else n_keys
    return (_rows(cache, "k", cur_pos, sink, win, n_keys, win_live_lo),
            _rows(cache, "v", cur_pos, sink, win, n_keys, win_live_lo))
