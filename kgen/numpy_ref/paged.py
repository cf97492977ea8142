"""A paged KV cache on NumPy arrays: pages ``[num_blocks][block_size][n_head_kv][row]``
in a format's layout, a block table per request and its length, the store the
append kernels do (``reshape_and_cache``: token t to ``slot_mapping[t]``, negative
slots skipped), and each request's rows gathered into a contiguous cache, so the
dense references apply unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kgen.formats import KvFormat, KvPair, as_pair

from .cache import HostCache


@dataclass
class PagedCache:
    fmt: KvFormat
    k: np.ndarray
    v: np.ndarray
    k_scale: float = 1.0
    v_scale: float = 1.0
    v_fmt: KvFormat | None = None  # the V rows' format (None: fmt's)

    @property
    def pair(self) -> KvPair:
        return KvPair(self.fmt, self.v_fmt or self.fmt)

    @classmethod
    def empty(cls, fmt: KvFormat | KvPair | str, num_blocks: int, block_size: int,
              n_head_kv: int, head_dim: int, k_scale: float = 1.0,
              v_scale: float = 1.0) -> PagedCache:
        """Pages whose every unwritten row decodes to NaN (``fmt``: a format, or a pair
        of K and V formats)."""
        pair = as_pair(fmt)
        k, v = (np.full((num_blocks, block_size, n_head_kv, f.row_width(head_dim)),
                        f.poison(), f.dtype) for f in (pair.k, pair.v))
        return cls(pair.k, k, v, k_scale, v_scale, pair.v if pair.mixed else None)

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def store(self, k_new: np.ndarray, v_new: np.ndarray, slot_mapping: np.ndarray) -> None:
        """``reshape_and_cache``: token t's rows (every kv head) to slot_mapping[t]."""
        slots = np.asarray(slot_mapping).reshape(-1)
        keep = slots >= 0
        flat_k = self.k.reshape(-1, *self.k.shape[2:])
        flat_v = self.v.reshape(-1, *self.v.shape[2:])
        kx = np.asarray(k_new, np.float32)[keep]
        vx = np.asarray(v_new, np.float32)[keep]
        flat_k[slots[keep]] = self.pair.k.quantize_rows(kx, self.k_scale)
        flat_v[slots[keep]] = self.pair.v.quantize_rows(vx, self.v_scale)


def slots_of(table_row: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The physical slot of each logical position of one request."""
    positions = np.asarray(positions)
    return table_row[positions // block_size] * block_size + positions % block_size


def dense(cache: PagedCache, table_row: np.ndarray, seq_len: int) -> HostCache:
    """One request's ``seq_len`` positions gathered into a contiguous cache."""
    slots = slots_of(table_row, np.arange(seq_len), cache.block_size)
    flat_k = cache.k.reshape(-1, *cache.k.shape[2:])[slots]  # [seq][hk][row]
    flat_v = cache.v.reshape(-1, *cache.v.shape[2:])[slots]
    return HostCache(cache.fmt, np.ascontiguousarray(np.swapaxes(flat_k, 0, 1)),
                     np.ascontiguousarray(np.swapaxes(flat_v, 0, 1)), {}, cache.k_scale,
                     cache.v_scale, cache.v_fmt)
