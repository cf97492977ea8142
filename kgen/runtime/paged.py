"""A paged KV cache, as the engine's attention op lays it out: pages of
``block_size`` positions ``[num_blocks][block_size][n_head_kv][row]`` shared by
every sequence, a block table per sequence, varlen prefill of several sequences
in one launch (each sequence's new query rows aligned to its end) and decode of
every sequence at its own length (split kernel + combine). Kernels are chosen by
their axes (position = paged) and the options a call asks for. K pages hold rows of
``kv``, V pages rows of ``v_kv`` (None: ``kv``'s; another format where a mixed pair
is generated, e.g. q8_0 K / f16 V).

Every launch reads lengths and tables from device tensors; the host passes only
shapes and an upper bound on lengths (no device-to-host read). ``prefill`` and
``decode`` upload those tensors with the call, so each call's arguments differ.
A decode step captured in a CUDA graph reads them from persistent tensors instead
(:class:`DecodeMetadata`, ``decode_metadata``): ``prepare`` (on the host, outside
the graph) takes each sequence's next slot and writes the block table, lengths and
slots into them in stream order, and ``decode_device`` launches the step over
them, with every argument and grid fixed by the batch size and an upper bound
``max_seq_len`` given when the metadata is made. Blocks are allocated on the host
from a free list. Every call checks all of its arguments, every launch against
its kernel's contracts (the tables and lengths it will upload among them) and the
blocks it needs before it takes a block, advances a length or launches anything
(kgen.runtime.calls).
"""

from __future__ import annotations

import math

import numpy as np

from kgen.ir.geometry import paged_prefill_grid
from kgen.runtime import device
from kgen.runtime.blocks import PagedBlocks
from kgen.runtime.calls import Calls
from kgen.runtime.contracts import ContractError
from kgen.runtime.convention import public, read_back
from kgen.runtime.kv import DEFAULT_KV, Scratch, attend_calls, cache_formats
from kgen.runtime.options import Options, count, groups, positive, scales
from kgen.runtime.pending import Pending, empty, upload
from kgen.runtime.planner import kernel_plan
from kgen.runtime.roles import CacheKernels

WHO = "PagedKVCache"  # how its refusals name it


def _listed(x) -> bool:
    return isinstance(x, list | tuple) or (isinstance(x, np.ndarray) and x.ndim == 1)


class DecodeMetadata:
    """What a graph-captured paged decode step reads in place, for a batch of at most
    ``batch`` sequences whose lengths stay within ``max_seq_len`` (the bound that
    sizes the grid): persistent int32 device tensors ``block_table``
    [batch][max_blocks_per_seq], ``seq_lens`` [batch] (each sequence's length with
    the step's token) and ``slot_mapping`` [batch] (the page slot its token is
    stored at; -1 skips a padding row), and the partials the step writes. Made by
    ``PagedKVCache.decode_metadata``, written by ``PagedKVCache.prepare`` before
    each step (outside the graph, in stream order), read by
    ``PagedKVCache.decode_device`` (the step, which a graph captures)."""

    def __init__(self, cache: PagedKVCache, batch: int, max_seq_len: int):
        cp = device.cupy()
        self.cache, self.batch, self.max_seq_len = cache, batch, max_seq_len
        self.block_table = cp.zeros((batch, cache.max_blocks), np.int32)
        self.seq_lens = cp.zeros(batch, np.int32)
        self.slot_mapping = cp.zeros(batch, np.int32)
        self.scratch = Scratch()  # its own: a captured step keeps writing these buffers
        self.sids: tuple[int, ...] = ()  # the sequences the last prepare staged, in rows
        self.lengths: tuple[int, ...] = ()  # their lengths with that step's token
        self.staged: tuple[np.ndarray, ...] = ()  # the host values it wrote


def prefill_calls(calls: Calls, kernels: CacheKernels, scratch: Scratch, q, k, v, index: dict,
                  max_rows: int, requests: int, G: int, opts: Options, scales: dict,
                  out) -> tuple:
    """The launches of a varlen paged prefill of ``requests`` requests (at most
    ``max_rows`` query rows each) over pages ``k``, ``v`` through ``index`` (block_table,
    seq_lens, query_start_loc) into ``out``: the kernel serving G q heads per kv head and
    the options, split where its tiles leave SMs idle (one request splits as the dense
    cache's prefill of its rows: the same bits). Returns (the kernel, the kernel that
    attends, its splits). Shared by PagedKVCache and kgen.runtime.engine."""
    kp, fn = kernels.get("prefill_paged", G, needs=opts.needs("prefill_paged"), rows=max_rows)
    n_head_kv = int(k.shape[2])
    grid = paged_prefill_grid(kp, int(q.shape[0]), max_rows, G, n_head_kv, requests)
    ran, splits = attend_calls(calls, kernels, scratch, kp, fn, (q, k, v), out,
                               math.prod(grid), G,
                               dict(**index, max_query_len=max_rows, **scales,
                                    **opts.kwargs(kp, q.shape[1]), validate_pos=False))
    return kp, ran, splits


def decode_kernels(kernels: CacheKernels, n_head_kv: int, G: int, opts: Options, kps,
                   splits_cap, batch: int, who: str) -> tuple:
    """(decode kernel, its launcher, combine kernel, its launcher, kps, splits_cap): the
    kernels serving ``G`` q heads per KV head with ``opts``, and the plan for ``batch``
    sequences (the given one checked, the missing parts derived: kgen.runtime.plan)."""
    kd, fdec = kernels.get("decode_paged", G, needs=opts.needs("decode_paged"))
    kps, splits_cap = kernel_plan(kd, kernels.head_dim, n_head_kv, kps, splits_cap, who, batch)
    kc, fcomb = kernels.get("combine", needs=opts.needs("combine"))
    return kd, fdec, kc, fcomb, kps, splits_cap


def decode_calls(calls: Calls, scratch: Scratch, q, k, v, index: dict, bound: int, plan: tuple,
                 opts: Options, scales: dict, sinks, out):
    """The launches of a paged decode of q [R][n_head][hd] (one row a sequence) over pages
    ``k``, ``v`` through ``index`` (block_table, seq_lens), ``bound`` the host's bound on
    the lengths, ``plan`` = (decode kernel, its launcher, combine kernel, its launcher,
    kps, splits_cap): the split decode and the combine into ``out`` (None: a new one).
    Returns the output, [R * n_head][hd]. Shared by PagedKVCache and
    kgen.runtime.engine."""
    kd, fdec, kc, fcomb, kps, splits_cap = plan
    R, n_head, hd = (int(x) for x in q.shape)
    # Every row's plan has at most min(ceil(bound / kps), cap) splits: the width.
    width = min(max(-(-bound // kps), 1), splits_cap)
    heads = R * n_head
    m, l, acc = scratch.pending(heads, width, hd)
    calls.add(fdec, q, k, v, m, l, acc, **index, kps=kps, splits_cap=splits_cap,
              max_seq_len=bound, **scales, **opts.kwargs(kd), validate_pos=False)
    flat = empty((heads, hd)) if out is None else out.reshape(heads, hd)
    tiled = opts.combine_arrays(kc)
    if tiled:  # one sink logit per q head, for every sequence's heads
        calls.source(fcomb, "sinks", sinks)
        tiled = (Pending((heads,), np.float32, lambda: device.cupy().tile(sinks, R)),)
    calls.add(fcomb, m, l, acc, flat, *tiled, n_splits=width)
    return flat


class PagedKVCache(PagedBlocks):
    WHO = WHO

    def __init__(self, num_blocks: int, block_size: int, n_head_kv: int, head_dim: int,
                 kv: str = DEFAULT_KV, max_blocks_per_seq: int | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0,
                 variants: dict[str, str] | None = None, v_kv: str | None = None):
        self.pair = cache_formats(WHO, kv, v_kv)  # K rows kv, V rows v_kv (None: kv's)
        self.fmt, self.kv, self.v_kv = self.pair.k, kv, self.pair.v.name
        self._init_blocks(num_blocks, block_size, max_blocks_per_seq)
        self.n_head_kv = positive("n_head_kv", n_head_kv, WHO)
        self.head_dim = positive("head_dim", head_dim, WHO)
        self.k_scale, self.v_scale = scales(self.pair, k_scale, v_scale, WHO)
        self.kernels = CacheKernels(kv, head_dim, variants, layout_role="append_paged",
                                    v_kv=self.v_kv)
        if not self.pair.accepts_head_dim(head_dim):
            raise ContractError(WHO, "row format", f"head_dim {head_dim} is not "
                                f"whole {self.pair.name} blocks")
        cp = device.cupy()
        self.k, self.v = (cp.zeros((num_blocks, block_size, n_head_kv, f.row_width(head_dim)),
                                   f.dtype) for f in (self.pair.k, self.pair.v))
        self._reset_blocks()
        self.scratch = Scratch()
        self.prefill_scratch = Scratch()  # a split prefill's partials
        self.last_prefill: str | None = None  # the prefill kernel the last prefill chose
        self.last_prefill_split: str | None = None  # its split twin, where that ran
        self.last_prefill_splits = 1  # the key splits it ran (the whole kernel: 1)

    # ---- launches ----------------------------------------------------------------

    @property
    def _scales(self) -> dict:
        scale = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        return {name: scale[name] for name in self.pair.scale_scalars()}

    def _check_rows(self, name, x, rows):
        want = (rows, self.n_head_kv, self.head_dim)
        if getattr(x, "dtype", None) != np.float32 or tuple(getattr(x, "shape", ())) != want:
            raise ContractError(WHO, "shape", f"{name} must be float32 {want}, "
                                f"not {getattr(x, 'dtype', type(x))} "
                                f"{tuple(getattr(x, 'shape', ()))}")

    def _check_q(self, q, rows: int) -> int:
        """q is float32 [rows][n_head][head_dim], n_head a multiple of n_head_kv;
        returns the q heads per KV head."""
        shape = tuple(getattr(q, "shape", ()))
        if getattr(q, "dtype", None) != np.float32 or len(shape) != 3 or \
                shape[0] != rows or shape[2] != self.head_dim:
            raise ContractError(WHO, "shape", f"q must be float32 [{rows}][n_head]"
                                f"[{self.head_dim}], not {getattr(q, 'dtype', type(q))} "
                                f"{shape}")
        return groups(shape[1], self.n_head_kv, WHO)

    @public("PagedKVCache.append", widen_args=("k_new", "v_new"))
    def append(self, sids: list[int], k_new, v_new, rows: list[int], stream=None) -> None:
        """Store ``rows[i]`` new rows of sequence ``sids[i]`` (k_new/v_new hold them in
        that order) at the end of each sequence: one reshape_and_cache launch."""
        calls = Calls()
        rows, tables = self._append_calls(calls, sids, k_new, v_new, rows)
        calls.run(stream)
        self._commit(sids, rows, tables)

    def _append_calls(self, calls: Calls, sids, k_new, v_new, rows
                      ) -> tuple[list[int], dict[int, list[int]]]:
        """The append launch (none for no rows); returns the row counts and the
        tables the sequences will have."""
        rows = self._batch(sids, rows)
        self._check_rows("k_new", k_new, sum(rows))
        self._check_rows("v_new", v_new, sum(rows))
        tables = self._grown(sids, rows)
        slots = np.concatenate([self._slots(tables[sid], range(self.lengths[sid],
                                                               self.lengths[sid] + n))
                                for sid, n in zip(sids, rows, strict=True)])
        if slots.size:
            _, fn = self.kernels.get("append_paged")
            calls.add(fn, k_new, v_new, self.k, self.v, upload(slots.astype(np.int32)),
                      **self._scales, validate_pos=False)
        return rows, tables

    def _uploads(self, sids, rows, tables) -> dict:
        """The block table and lengths every sequence will have, as uploads (made here
        from checked arguments: the checks need not read them back)."""
        lens = np.array([self.lengths[s] + n for s, n in zip(sids, rows, strict=True)],
                        np.int32)
        return {"block_table": upload(self._block_table([tables[s] for s in sids])),
                "seq_lens": upload(lens)}

    @public("PagedKVCache.prefill", widen_args=("q", "k_new", "v_new"), arrays=("sinks",),
            out_like="q")
    def prefill(self, sids: list[int], q, k_new, v_new, rows: list[int], attn_sink: int = 0,
                attn_win: int = 0, scale: float | None = None, window_size=None,
                softcap: float = 0.0, sinks=None, causal: bool = True, stream=None):
        """A varlen batch: ``rows[i]`` new tokens of sequence ``sids[i]`` (q, k_new and
        v_new concatenated in that order) are appended, and each query row attends
        causally over its sequence, aligned to its end (``causal=False``: every row
        sees all of its sequence's keys). Returns out [sum(rows)][H][hd]."""
        counts = self._batch(sids, rows)
        G = self._check_q(q, sum(counts))
        opts = Options.checked(q.shape[1], attn_sink, attn_win, scale, window_size, softcap, sinks,
                               causal)
        calls = Calls()
        rows, tables = self._append_calls(calls, sids, k_new, v_new, counts)
        qsl = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
        out = empty(q.shape)
        index = dict(**self._uploads(sids, rows, tables), query_start_loc=upload(qsl))
        kp, ran, splits = prefill_calls(calls, self.kernels, self.prefill_scratch, q, self.k,
                                        self.v, index, max(rows), len(rows), G, opts,
                                        self._scales, out)
        calls.run(stream)
        self._commit(sids, rows, tables)
        self.last_prefill = kp.name
        self.last_prefill_split = None if splits == 1 else ran.name
        self.last_prefill_splits = splits
        return out.made()

    @public("PagedKVCache.decode", widen_args=("q", "k_new", "v_new"), arrays=("sinks",),
            out_like="q")
    def decode(self, sids: list[int], q, k_new, v_new, kps: int | None = None,
               splits_cap: int | None = None, attn_sink: int = 0, attn_win: int = 0,
               scale: float | None = None, window_size=None, softcap: float = 0.0, sinks=None,
               stream=None):
        """One new token per sequence, then every sequence attends at its own length
        (split decode + combine). q [len(sids)][n_head][hd]; returns the same shape.
        With no plan given, the one derived from the device and the kernel
        (kgen.runtime.plan.default_plan: the dense cache's rule, its cap shared among
        the sequences, so one sequence decodes with the dense plan, bit for bit). Where
        no decode kernel serves the group count, the step runs as a prefill of one row a
        sequence (the query tile, whose rows pack the q heads)."""
        self._batch(sids)
        R = len(sids)
        G = self._check_q(q, R)
        n_head = q.shape[1]
        opts = Options.checked(n_head, attn_sink, attn_win, scale, window_size, softcap, sinks,
                               True)
        if self.kernels.by_prefill("decode_paged", "prefill_paged", G, opts, kps, splits_cap,
                                   WHO, "a one-row-a-sequence prefill, which splits its keys by "
                                   "its own rule"):
            # The varlen prefill of one row a sequence attends each sequence to its end, as
            # a decode does.
            return self.prefill(sids, q, k_new, v_new, [1] * R, attn_sink, attn_win, scale,
                                window_size, softcap, sinks, True, stream)
        plan = self._decode_kernels(G, opts, kps, splits_cap, R)
        calls = Calls()
        rows, tables = self._append_calls(calls, sids, k_new, v_new, [1] * R)
        bound = max(self.lengths[s] + 1 for s in sids)
        out = decode_calls(calls, self.scratch, q, self.k, self.v,
                           self._uploads(sids, rows, tables), bound, plan, opts, self._scales,
                           sinks, None)
        calls.run(stream)
        self._commit(sids, rows, tables)
        return out.made().reshape(R, n_head, self.head_dim)

    def _decode_kernels(self, G: int, opts: Options, kps, splits_cap, batch: int) -> tuple:
        """(decode kernel, its launcher, combine kernel, its launcher, kps, splits_cap):
        the kernels serving ``G`` q heads per KV head with ``opts``, and the plan
        (the given one checked, the missing parts derived: kgen.runtime.plan)."""
        return decode_kernels(self.kernels, self.n_head_kv, G, opts, kps, splits_cap, batch,
                              WHO)

    # ---- decode captured in a CUDA graph ---------------------------------------------

    def decode_metadata(self, batch: int, max_seq_len: int) -> DecodeMetadata:
        """Persistent device tensors for decode steps of at most ``batch`` sequences,
        each at most ``max_seq_len`` keys long with the step's token (the upper bound
        that sizes the decode grid; at most max_blocks_per_seq * block_size). Made
        once, before a graph is captured: the graph reads them in place."""
        batch = positive("batch", batch, WHO)
        held = self.max_blocks * self.block_size
        max_seq_len = count("max_seq_len", max_seq_len, 1, WHO, held)
        return DecodeMetadata(self, batch, max_seq_len)

    def _own(self, meta) -> DecodeMetadata:
        if not isinstance(meta, DecodeMetadata) or meta.cache is not self:
            raise ContractError(WHO, "metadata", "meta must be the DecodeMetadata this "
                                f"cache's decode_metadata made, not {type(meta).__name__}")
        return meta

    def prepare(self, meta: DecodeMetadata, sids: list[int], stream=None) -> tuple[int, ...]:
        """Ready the next decode step of ``sids`` (one new token each) in ``meta``:
        on the host, outside any graph, before the step (``decode_device``, or a
        replay of the graph that captured it). Takes each sequence's next slot (a new
        block where it crosses one), advances its length, and writes the block
        table, the lengths with the token and the token's slots into ``meta``'s
        tensors in the order of ``stream`` (the stream the step runs on, so the step
        reads them after this and the previous step read them before); rows past
        ``len(sids)`` are padding (slot -1: nothing stored; one key of block 0 read,
        their output is meaningless). Everything is checked before any block is
        taken or anything written. Returns the lengths. The step must follow:
        the lengths count its token."""
        self._own(meta)
        self._batch(sids)
        n = len(sids)
        if n > meta.batch:
            raise ContractError(WHO, "metadata", f"{n} sequences for metadata of batch "
                                f"{meta.batch}")
        for sid in sids:
            if self.lengths[sid] + 1 > meta.max_seq_len:
                raise ContractError(WHO, "max_seq_len", f"sequence {sid} would hold "
                                    f"{self.lengths[sid] + 1} keys, above the metadata's "
                                    f"max_seq_len = {meta.max_seq_len}")
        rows = [1] * n
        tables = self._grown(sids, rows)
        table = np.zeros((meta.batch, self.max_blocks), np.int32)
        table[:n] = self._block_table([tables[s] for s in sids])
        lens = np.ones(meta.batch, np.int32)
        lens[:n] = [self.lengths[s] + 1 for s in sids]
        slots = np.full(meta.batch, -1, np.int32)
        slots[:n] = [self._slots(tables[s], range(self.lengths[s], self.lengths[s] + 1))[0]
                     for s in sids]
        for dev, host in ((meta.block_table, table), (meta.seq_lens, lens),
                          (meta.slot_mapping, slots)):
            dev.set(host, stream=stream)
        self._commit(sids, rows, tables)
        meta.sids, meta.lengths = tuple(sids), tuple(int(x) for x in lens[:n])
        meta.staged = (table, lens, slots)
        return meta.lengths

    @public("PagedKVCache.decode_device", widen_args=("q", "k_new", "v_new"),
            arrays=("sinks", "out"))
    def decode_device(self, q, k_new, v_new, meta: DecodeMetadata, kps: int | None = None,
                      splits_cap: int | None = None, attn_sink: int = 0, attn_win: int = 0,
                      scale: float | None = None, window_size=None, softcap: float = 0.0,
                      sinks=None, out=None, validate: bool | None = None, stream=None):
        """The decode step ``prepare`` readied in ``meta``, capturable in a CUDA graph:
        append each row's token at its slot, split decode and combine, every launch
        reading ``meta``'s tensors in place, its arguments and grid fixed by
        ``meta.batch`` and ``meta.max_seq_len`` (a replay of the graph after the
        next ``prepare`` runs the next step). q [batch][n_head][head_dim], k_new and
        v_new [batch][n_head_kv][head_dim] (a padding row's values are ignored);
        ``out`` float32 [batch][n_head][head_dim], or None for a new one (in a
        capture, pass one); ``sinks`` float32 [batch][n_head] (one logit per q head
        of each row: a tiled copy made once, outside the graph). Options and plan as
        for ``decode``; with the same ones the bits are ``decode``'s (a default plan
        is derived for ``meta.batch`` sequences, padding rows counted: the graph's
        arguments are fixed by it, so it is ``decode``'s for as many sequences). Every launch is
        checked before the first runs; with ``validate`` (device-to-host reads; None,
        the default: unless the stream is capturing a graph)
        that includes the tensors' values, without it (in a capture) they are as
        ``prepare`` wrote them. Run it once outside the capture first (it loads the
        kernels and allocates the partials ``meta`` keeps)."""
        self._own(meta)
        if not meta.sids:
            raise ContractError(WHO, "metadata", "no step prepared: call prepare(meta, "
                                "sids) first")
        for sid, n in zip(meta.sids, meta.lengths, strict=True):
            if sid not in self.tables or self.lengths[sid] != n:
                raise ContractError(WHO, "metadata", f"sequence {sid} changed since "
                                    "prepare staged it (freed, or another call advanced "
                                    "it): prepare again")
        B = meta.batch
        G = self._check_q(q, B)
        self._check_rows("k_new", k_new, B)
        self._check_rows("v_new", v_new, B)
        n_head = q.shape[1]
        per_head = None
        if sinks is not None:
            if (getattr(sinks, "dtype", None) != np.float32
                    or tuple(getattr(sinks, "shape", ())) != (B, n_head)
                    or not getattr(getattr(sinks, "flags", None), "c_contiguous", False)):
                raise ContractError(WHO, "sinks", f"sinks must be C-contiguous float32 "
                                    f"[{B}][{n_head}] (one logit per q head of each row), "
                                    f"not {getattr(sinks, 'dtype', type(sinks).__name__)} "
                                    f"{tuple(getattr(sinks, 'shape', ()))}")
            per_head = sinks[0]
        opts = Options.checked(n_head, attn_sink, attn_win, scale, window_size, softcap, per_head,
                               True)
        kd, fdec, kc, fcomb, kps, splits_cap = self._decode_kernels(G, opts, kps, splits_cap, B)
        heads = B * n_head
        if out is not None:
            want = (B, n_head, self.head_dim)
            if (getattr(out, "dtype", None) != np.float32
                    or tuple(getattr(out, "shape", ())) != want
                    or not getattr(getattr(out, "flags", None), "c_contiguous", False)):
                raise ContractError(WHO, "shape", f"out must be C-contiguous float32 "
                                    f"{list(want)}, not "
                                    f"{getattr(out, 'dtype', type(out).__name__)} "
                                    f"{tuple(getattr(out, 'shape', ()))}")
        validate_pos = read_back(validate, stream, WHO)
        # Every row's plan has at most min(ceil(bound / kps), cap) splits: the width.
        width = min(max(-(-meta.max_seq_len // kps), 1), splits_cap)
        m, l, acc = meta.scratch.pending(heads, width, self.head_dim)
        flat = empty((heads, self.head_dim)) if out is None else \
            out.reshape(heads, self.head_dim)
        _, fapp = self.kernels.get("append_paged")
        calls = Calls()
        calls.add(fapp, k_new, v_new, self.k, self.v, meta.slot_mapping, **self._scales,
                  validate_pos=validate_pos)
        calls.add(fdec, q, self.k, self.v, m, l, acc, meta.block_table, meta.seq_lens,
                  kps=kps, splits_cap=splits_cap, max_seq_len=meta.max_seq_len,
                  **self._scales, **opts.kwargs(kd), validate_pos=validate_pos)
        tiled = (sinks.reshape(heads),) if opts.combine_arrays(kc) else ()
        calls.add(fcomb, m, l, acc, flat, *tiled, n_splits=width)
        if validate_pos and stream is not None:
            stream.synchronize()  # the checks read meta's tensors: after prepare wrote them
        calls.run(stream)
        return out if out is not None else flat.made().reshape(B, n_head, self.head_dim)
