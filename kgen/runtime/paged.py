"""A paged KV cache, as the engine's attention op lays it out: pages of
``block_size`` positions ``[num_blocks][block_size][n_head_kv][row]`` shared by
every sequence, a block table per sequence, varlen prefill of several sequences
in one launch (each sequence's new query rows aligned to its end) and decode of
every sequence at its own length (split kernel + combine). Kernels are chosen by
their axes (position = paged) and the options a call asks for.

Every launch reads lengths and tables from device tensors the host uploads; the
host passes only shapes and an upper bound on lengths (no device-to-host read),
so a decode step can be captured in a CUDA graph. Blocks are allocated on the
host from a free list; a call that would run out of blocks is refused before
anything changes.
"""

from __future__ import annotations

import numpy as np

from kgen.formats import FORMATS
from kgen.ir.params import INT_MAX
from kgen.runtime import device
from kgen.runtime.contracts import ContractError
from kgen.runtime.kv import DEFAULT_KV, Scratch
from kgen.runtime.options import Options, param, positive
from kgen.runtime.plan import DEFAULT_KPS, DEFAULT_SPLITS_CAP
from kgen.runtime.roles import CacheKernels


class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int, n_head_kv: int, head_dim: int,
                 kv: str = DEFAULT_KV, max_blocks_per_seq: int | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0,
                 variants: dict[str, str] | None = None):
        if kv not in FORMATS:
            raise ContractError("PagedKVCache", "kv", f"kv must be one of {sorted(FORMATS)}")
        self.fmt, self.kv = FORMATS[kv], kv
        self.num_blocks = positive("num_blocks", num_blocks)
        self.block_size = positive("block_size", block_size)
        self.n_head_kv = positive("n_head_kv", n_head_kv)
        self.head_dim = positive("head_dim", head_dim)
        self.max_blocks = positive("max_blocks_per_seq", max_blocks_per_seq or num_blocks)
        if num_blocks * block_size > INT_MAX:
            raise ContractError("PagedKVCache", "range", "positions overflow int32")
        self.k_scale = param("k_scale", k_scale)
        self.v_scale = param("v_scale", v_scale)
        self.kernels = CacheKernels(kv, head_dim, variants, layout_role="append_paged")
        if not self.fmt.accepts_head_dim(head_dim):
            raise ContractError("PagedKVCache", "row format", f"head_dim {head_dim} is not "
                                f"whole {kv} blocks")
        cp = device.cupy()
        shape = (num_blocks, block_size, n_head_kv, self.fmt.row_width(head_dim))
        self.k = cp.zeros(shape, self.fmt.dtype)
        self.v = cp.zeros(shape, self.fmt.dtype)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._next = 0
        self.scratch = Scratch()

    # ---- sequences ---------------------------------------------------------------

    def add(self) -> int:
        """A new, empty sequence; returns its id."""
        sid = self._next
        self._next += 1
        self.tables[sid], self.lengths[sid] = [], 0
        return sid

    def free(self, sid: int) -> None:
        """Give a sequence's blocks back."""
        self._known(sid)
        self.free_blocks.extend(reversed(self.tables.pop(sid)))
        del self.lengths[sid]

    def _known(self, sid: int) -> None:
        if sid not in self.tables:
            raise ContractError("PagedKVCache", "sequence", f"no sequence {sid}")

    def _reserve(self, grow: dict[int, int]) -> None:
        """Blocks for every sequence to reach its new length, all or nothing."""
        need = {}
        for sid, new_len in grow.items():
            blocks = -(-new_len // self.block_size)
            if blocks > self.max_blocks:
                raise ContractError("PagedKVCache", "max_blocks_per_seq", f"sequence {sid} "
                                    f"would need {blocks} blocks (at most {self.max_blocks})")
            need[sid] = blocks - len(self.tables[sid])
        if sum(need.values()) > len(self.free_blocks):
            raise ContractError("PagedKVCache", "out of blocks", f"needs {sum(need.values())} "
                                f"more blocks, {len(self.free_blocks)} free")
        for sid, n in need.items():
            self.tables[sid] += [self.free_blocks.pop() for _ in range(max(n, 0))]

    def block_table(self, sids: list[int]) -> np.ndarray:
        """int32 [len(sids)][max_blocks]: each sequence's physical blocks (0-padded)."""
        out = np.zeros((len(sids), self.max_blocks), np.int32)
        for i, sid in enumerate(sids):
            out[i, : len(self.tables[sid])] = self.tables[sid]
        return out

    def slot_mapping(self, sid: int, positions: range) -> np.ndarray:
        t = self.tables[sid]
        bs = self.block_size
        return np.array([t[p // bs] * bs + p % bs for p in positions], np.int32)

    # ---- launches ----------------------------------------------------------------

    @property
    def _scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale} \
            if self.fmt.tensor_scales else {}

    def _check_rows(self, name, x, rows):
        want = (rows, self.n_head_kv, self.head_dim)
        if getattr(x, "dtype", None) != np.float32 or tuple(getattr(x, "shape", ())) != want:
            raise ContractError("PagedKVCache", "shape", f"{name} must be float32 {want}, "
                                f"not {getattr(x, 'dtype', type(x))} "
                                f"{tuple(getattr(x, 'shape', ()))}")

    def append(self, sids: list[int], k_new, v_new, rows: list[int], stream=None) -> None:
        """Store ``rows[i]`` new rows of sequence ``sids[i]`` (k_new/v_new hold them in
        that order) at the end of each sequence: one reshape_and_cache launch."""
        cp = device.cupy()
        for sid in sids:
            self._known(sid)
        if len(set(sids)) != len(sids) or len(rows) != len(sids):
            raise ContractError("PagedKVCache", "sequence", "each sequence once, with its rows")
        self._check_rows("k_new", k_new, sum(rows))
        self._check_rows("v_new", v_new, sum(rows))
        self._reserve({sid: self.lengths[sid] + n for sid, n in zip(sids, rows, strict=True)})
        slots = np.concatenate([self.slot_mapping(sid, range(self.lengths[sid],
                                                             self.lengths[sid] + n))
                                for sid, n in zip(sids, rows, strict=True)])
        _, fn = self.kernels.get("append_paged")
        fn(k_new, v_new, self.k, self.v, cp.asarray(slots), **self._scales,
           validate_pos=False, stream=stream)
        for sid, n in zip(sids, rows, strict=True):
            self.lengths[sid] += n

    def prefill(self, sids: list[int], q, k_new, v_new, rows: list[int], attn_sink: int = 0,
                attn_win: int = 0, scale: float | None = None, window=None,
                softcap: float = 0.0, sinks=None, stream=None):
        """A varlen batch: ``rows[i]`` new tokens of sequence ``sids[i]`` (q, k_new and
        v_new concatenated in that order) are appended, and each query row attends
        causally over its sequence, aligned to its end. Returns out [sum(rows)][H][hd]."""
        cp = device.cupy()
        n = sum(rows)
        if getattr(q, "ndim", 0) != 3 or q.shape[0] != n or q.dtype != np.float32:
            raise ContractError("PagedKVCache", "shape", f"q must be float32 [{n}][n_head]"
                                f"[{self.head_dim}]")
        opts = Options.checked(q.shape[1], attn_sink, attn_win, scale, window, softcap, sinks,
                               True)
        kp, fn = self.kernels.get("prefill_paged", q.shape[1] // self.n_head_kv,
                                  needs=opts.needs("prefill_paged"))
        self.append(sids, k_new, v_new, rows, stream=stream)
        qsl = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
        lens = np.array([self.lengths[s] for s in sids], np.int32)
        out = cp.empty(q.shape, cp.float32)
        fn(q, self.k, self.v, out, block_table=cp.asarray(self.block_table(sids)),
           seq_lens=cp.asarray(lens), query_start_loc=cp.asarray(qsl), **self._scales,
           **opts.kwargs(kp, q.shape[1]), validate_pos=False, stream=stream)
        return out

    def decode(self, sids: list[int], q, k_new, v_new, kps: int = DEFAULT_KPS,
               splits_cap: int = DEFAULT_SPLITS_CAP, attn_sink: int = 0, attn_win: int = 0,
               scale: float | None = None, window=None, softcap: float = 0.0, sinks=None,
               stream=None):
        """One new token per sequence, then every sequence attends at its own length
        (split decode + combine). q [len(sids)][n_head][hd]; returns the same shape."""
        cp = device.cupy()
        R = len(sids)
        if getattr(q, "ndim", 0) != 3 or q.shape[0] != R or q.dtype != np.float32:
            raise ContractError("PagedKVCache", "shape", f"q must be float32 [{R}][n_head]"
                                f"[{self.head_dim}]")
        n_head = q.shape[1]
        opts = Options.checked(n_head, attn_sink, attn_win, scale, window, softcap, sinks, True)
        kps, splits_cap = positive("kps", kps), positive("splits_cap", splits_cap)
        kd, fdec = self.kernels.get("decode_paged", n_head // self.n_head_kv,
                                    needs=opts.needs("decode_paged"))
        kc, fcomb = self.kernels.get("combine", needs=opts.needs("combine"))
        self.append(sids, k_new, v_new, [1] * R, stream=stream)
        lens = [self.lengths[s] for s in sids]
        bound = max(lens)
        width = min(max(-(-bound // kps), 1), splits_cap)
        heads = R * n_head
        m, l, acc = self.scratch.get(heads, width, self.head_dim)
        fdec(q, self.k, self.v, m, l, acc, block_table=cp.asarray(self.block_table(sids)),
             seq_lens=cp.asarray(np.array(lens, np.int32)), kps=kps, splits_cap=splits_cap,
             max_seq_len=bound, **self._scales, **opts.kwargs(kd), validate_pos=False,
             stream=stream)
        out = cp.empty((heads, self.head_dim), cp.float32)
        tiled = opts.combine_arrays(kc)
        if tiled:  # one sink logit per q head, for every sequence's heads
            tiled = (cp.tile(tiled[0], R),)
        fcomb(m, l, acc, out, *tiled, n_splits=width, stream=stream)
        return out.reshape(R, n_head, self.head_dim)
