"""The engine's multi-head latent attention ops as calls, and :class:`MLACache`.

The latent cache is pages ``[num_blocks][block_size][MLA_ROW]`` (kgen.ir.geometry:
kv_lora_rank MLA_LATENT latent columns, then MLA_ROPE rotary ones), one KV head, V the
first MLA_LATENT columns of a row (../shared/docs/engine-ops.md). Its elements, and those
of the rows stored, the queries and the prefill's q, K and V, are float32, bf16 (uint16
bit patterns, kgen.formats.bf16) or float16 (kgen.ir.axes.IoDtype: in_dtype); outputs are
float32 or one of those (out_dtype); the math, the split partials and every LSE are f32:

* ``concat_and_cache_mla`` -- kv_c ``[T, 512]`` and k_pe ``[T, 64]`` (rows may be
  strided) into the slots of slot_mapping ``[S]`` int64 (S <= T; a negative slot skips).
* ``gather_mla_cache`` -- requests' context rows out of the pages into a contiguous
  ``[N, 576]`` workspace laid out by cu_seq_lens (from seq_starts[b] on, if given).
* ``mla_prefill_attention`` -- varlen prefill attention with QK head size 192 and V
  head size 128 over contiguous K/V (causal bottom-right aligned, or over every key).
* ``mla_decode_attention`` -- decode of one query per request over its paged latent
  rows: the split stage (mla_decode) writes each key split's max, sum and weighted V,
  the merge stage (mla_combine) merges the splits in ascending order (empty splits
  skipped by both), writing out ``[B, Hq, 512]`` and, if given, lse ``[B, Hq]``.

Each call picks its kernel by its axes (the element types from its arrays' dtypes: the
latent rows' or q's for in_dtype, out's for out_dtype) and checks every contract before
the GPU is touched (kgen.runtime.bind); the decode checks both stages' arguments before it launches
the first. The index tensors are device tensors read in place (a graph can capture the
launches); the host also reads them back and checks them unless ``validate`` says not
(kgen.runtime.convention.read_back: by default, not while the stream captures a graph).
"""

from __future__ import annotations

import numpy as np

from kgen.ir.axes import IoDtype, Lse, Mask, Op, SeqStarts
from kgen.ir.geometry import MLA_LATENT, MLA_ROPE, MLA_ROW, mla_default_splits
from kgen.ir.params import ENTRY_PARAMS, INT_MAX
from kgen.ops import get
from kgen.runtime import device
from kgen.runtime.blocks import PagedBlocks
from kgen.runtime.calls import Calls
from kgen.runtime.contracts import ContractError
from kgen.runtime.convention import public, read_back
from kgen.runtime.options import count, dtype_name, io_dtype, is_int, positive
from kgen.runtime.pending import empty, upload
from kgen.runtime.select import Role, find

_CHOSEN: dict[tuple, object] = {}  # (role, variant) -> launcher


def role(op: Op, in_dtype: IoDtype = IoDtype.F32, out_dtype: IoDtype = IoDtype.F32,
         **needs: str) -> Role:
    """What an MLA call needs a kernel for: its op, the option axes it asks and the
    element types of its inputs and outputs (where the op has them: its in_dtype,
    out_dtype)."""
    return get(op).role(in_dtype, out_dtype, **needs)


def launcher(r: Role, variant: str | None = None):
    """The generated launcher serving ``r`` (``variant``: a kernel name, checked to serve
    it); chosen once, then kept."""
    key = (r, variant)
    fn = _CHOSEN.get(key)
    if fn is None:
        fn = _CHOSEN[key] = find(r, get(r.op).mla_width(), 1, variant)[1]
    return fn


@public("concat_and_cache_mla", arrays=("kv_c", "k_pe", "kv_cache", "slot_mapping"))
def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, *, validate: bool | None = None,
                         stream=None, variant: str | None = None):
    """Store token t's kv_c[t] and k_pe[t] as the latent row of slot slot_mapping[t]
    (t < S = len(slot_mapping); a negative slot skips it; kv_c, k_pe and the cache of one
    element type, copied bit for bit). Returns the bound Launch."""
    fn = launcher(role(Op.MLA_STORE, io_dtype("kv_c", kv_c, "concat_and_cache_mla")), variant)
    return fn(kv_c, k_pe, kv_cache, slot_mapping,
              validate_pos=read_back(validate, stream, "concat_and_cache_mla"), stream=stream)


@public("gather_mla_cache", arrays=("dst", "src_cache", "block_table", "cu_seq_lens",
                                   "token_to_seq", "seq_starts"))
def gather_mla_cache(dst, src_cache, block_table, cu_seq_lens, token_to_seq, seq_starts,
                     num_tokens: int, *, validate: bool | None = None, stream=None,
                     variant: str | None = None):
    """Copy workspace rows i < num_tokens: request r = token_to_seq[i], its context row
    (seq_starts[r] if given, else 0) + i - cu_seq_lens[r] (dst and the cache of one element
    type, copied bit for bit). Returns the bound Launch."""
    given = seq_starts is not None
    fn = launcher(role(Op.MLA_GATHER, io_dtype("src_cache", src_cache, "gather_mla_cache"),
                       seq_starts=(SeqStarts.GIVEN if given else SeqStarts.NONE).value),
                  variant)
    arrays = (dst, src_cache, block_table, cu_seq_lens, token_to_seq) + \
        ((seq_starts,) if given else ())
    return fn(*arrays, num_tokens=num_tokens,
              validate_pos=read_back(validate, stream, "gather_mla_cache"), stream=stream)


def kv_splits(num_kv_splits, max_seq_len, who: str = "mla_decode_attention") -> int:
    """The split count of a decode: ``num_kv_splits``, or for 0 the default rule
    (kgen.ir.geometry.mla_default_splits, over this device's multiprocessors)."""
    p = ENTRY_PARAMS["num_kv_splits"]
    n = count("num_kv_splits", num_kv_splits, p.lo, who, p.hi)
    if n:
        return n
    bound = positive("max_seq_len", max_seq_len, who)
    return mla_default_splits(bound, device.sm_count())


@public("mla_decode_attention", arrays=("out", "lse", "query", "kv_cache", "block_table",
                                       "seq_lens"))
def mla_decode_attention(out, lse, query, kv_cache, block_table, seq_lens,
                         scale: float | None = None,
                         num_kv_splits: int = ENTRY_PARAMS["num_kv_splits"].default,
                         max_seq_len: int | None = None, *, validate: bool | None = None,
                         stream=None, variants: tuple[str | None, str | None] = (None, None)):
    """out[b, h] = sum_j softmax_j(scale * query[b, h] . row_j) row_j[:512] over request
    b's keys j < seq_lens[b] (rows through block_table), and lse[b, h] (unless None) =
    max + log sum exp (f32). query and kv_cache of one element type (in_dtype), out of
    its own (out_dtype). num_kv_splits: 0 for the default split count (from
    ``max_seq_len``, the host's bound on seq_lens; without it, the block table's
    capacity), 1 for one split (batch-invariant). Both stages are checked (every
    contract; the device tensors read back once unless ``validate`` says not: see
    kgen.runtime.convention.read_back) before the split
    partials are allocated or either launches; returns their (launcher, Launch) pairs."""
    calls = Calls()
    _decode_calls(calls, out, lse, query, kv_cache, block_table, seq_lens, scale,
                  num_kv_splits, max_seq_len, read_back(validate, stream,
                                                        "mla_decode_attention"), variants)
    return calls.run(stream)


def _decode_calls(calls: Calls, out, lse, query, kv_cache, block_table, seq_lens, scale,
                  num_kv_splits, max_seq_len, validate_pos, variants,
                  who: str = "mla_decode_attention") -> None:
    """The two launches of a decode, with pending split partials."""
    if type(validate_pos) is not bool:
        raise ContractError(who, "type", f"validate_pos must be True or False, not "
                            f"{validate_pos!r}")
    for name, x, rank in (("query", query, 3), ("kv_cache", kv_cache, 3),
                          ("block_table", block_table, 2)):
        if len(getattr(x, "shape", ())) != rank:
            raise ContractError(who, "shape", f"{name} must be an array of {rank} "
                                f"dimensions, not {x!r}")
    if max_seq_len is None:
        max_seq_len = int(block_table.shape[1]) * int(kv_cache.shape[1])
    if not is_int(max_seq_len) or not 1 <= max_seq_len <= INT_MAX:
        raise ContractError(who, "max_seq_len", f"max_seq_len must be an integer in [1, "
                            f"{INT_MAX}], not {max_seq_len!r}")
    splits = kv_splits(num_kv_splits, max_seq_len, who)
    B, H = int(query.shape[0]), int(query.shape[1])
    decode = launcher(role(Op.MLA_DECODE, io_dtype("kv_cache", kv_cache, who)), variants[0])
    combine = launcher(role(Op.MLA_COMBINE, out_dtype=io_dtype("out", out, who),
                            lse=(Lse.NONE if lse is None else Lse.WRITE).value), variants[1])
    m, l_ = empty((B, H, splits)), empty((B, H, splits))
    acc = empty((B, H, splits, MLA_LATENT))
    calls.add(decode, query, kv_cache, block_table, seq_lens, m, l_, acc, scale=scale,
              validate_pos=validate_pos)
    outs = (out,) if lse is None else (out, lse)
    calls.add(combine, m, l_, acc, seq_lens, *outs, validate_pos=False)  # read by the first


@public("mla_prefill_attention", arrays=("out", "lse", "query", "key", "value",
                                        "cu_seqlens_q", "cu_seqlens_k"))
def mla_prefill_attention(out, lse, query, key, value, cu_seqlens_q, cu_seqlens_k,
                          scale: float | None,
                          causal: bool, max_seqlen_q: int, max_seqlen_k: int | None = None, *,
                          validate: bool | None = None, stream=None,
                          variant: str | None = None):
    """Varlen attention with QK head size 192 and V head size 128 (H q heads = H kv heads):
    request r owns query rows [cu_seqlens_q[r], cu_seqlens_q[r+1]) and key rows likewise;
    ``causal``: query i of Lq sees keys j <= i + Lk - Lq (bottom-right aligned), else
    every key of its request. out [total_q, H, 128] (out_dtype); lse [H, total_q] f32 or
    None; query, key, value of one element type (in_dtype).
    ``max_seqlen_q`` (the host's bound on query rows) sizes the grid; ``max_seqlen_k`` is
    the engine's argument, checked (an int >= 1) and not needed by the kernel, which reads
    each request's key count on the device. Returns the bound Launch."""
    who = "mla_prefill_attention"
    if type(causal) is not bool:
        raise ContractError(who, "type", f"causal must be True or False, not {causal!r}")
    if max_seqlen_k is not None:
        count("max_seqlen_k", max_seqlen_k, 1, who)
    fn = launcher(role(Op.MLA_PREFILL, io_dtype("query", query, who), io_dtype("out", out, who),
                       mask=(Mask.CAUSAL if causal else Mask.FULL).value,
                       lse=(Lse.NONE if lse is None else Lse.WRITE).value), variant)
    outs = (out,) if lse is None else (out, lse)
    return fn(query, key, value, cu_seqlens_q, cu_seqlens_k, *outs, max_seqlen_q=max_seqlen_q,
              scale=scale, validate_pos=read_back(validate, stream, who), stream=stream)


class MLACache(PagedBlocks):
    """A paged latent cache (pages ``[num_blocks][block_size][576]`` of ``dtype``: f32,
    bf16 or f16, kgen.ir.axes.IoDtype; blocks from a host free list, a block table per
    sequence) that chains the MLA ops: ``store`` appends tokens' kv_c and k_pe rows
    (concat_and_cache_mla; rows of the cache's element type), ``decode`` stores one token
    per sequence and attends every sequence at its new length (the two-stage split
    decode; queries of the cache's element type, the output of ``out_dtype``: the cache's
    unless named), ``gather`` copies sequences' rows into a workspace (gather_mla_cache,
    the cache's element type: what ``mla_prefill_attention`` reads once the model has
    expanded it). Every call checks all of its arguments and every launch against its
    kernel's contracts before it takes a block, advances a length or launches."""

    WHO = "MLACache"

    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_seq: int | None = None,
                 variants: dict[str, str] | None = None, dtype: str | IoDtype = IoDtype.F32):
        self.dtype = dtype_name(dtype, self.WHO)
        self._init_blocks(num_blocks, block_size, max_blocks_per_seq)
        if not isinstance(variants, dict | None):
            raise ContractError(self.WHO, "variant", "variants maps a role to a kernel name "
                                f"(a dict), not {variants!r}")
        self.variants = dict(variants or {})
        unknown = set(self.variants) - {"store", "gather", "decode", "combine"}
        if unknown:
            raise ContractError(self.WHO, "variant", f"variants name the roles store, "
                                f"gather, decode and combine, not {sorted(unknown)}")
        for key, name in self.variants.items():  # each named kernel, refused here, not at use
            self._serves(key, name)
        self.elem = np.dtype(self.dtype.fmt.dtype)
        self.cache = device.cupy().zeros((num_blocks, block_size, MLA_ROW), self.elem)
        self._reset_blocks()

    def _serves(self, key: str, name) -> None:
        """The kernel ``name`` serves role ``key`` of this cache in one of the forms its
        calls ask for (gather: with or without seq_starts; combine: any out_dtype, with or
        without the LSE); else a ContractError naming the variant."""
        dt = self.dtype
        roles = {"store": [role(Op.MLA_STORE, dt)], "decode": [role(Op.MLA_DECODE, dt)],
                 "gather": [role(Op.MLA_GATHER, dt, seq_starts=s.value) for s in SeqStarts],
                 "combine": [role(Op.MLA_COMBINE, out_dtype=o, lse=x.value)
                             for o in IoDtype for x in Lse]}[key]
        first = None
        for r in roles:
            try:
                find(r, get(r.op).mla_width(), 1, name)
                return
            except ContractError as e:
                first = first or e
        raise ContractError(self.WHO, "variant", f"variants[{key!r}] = {name!r}: "
                            f"{first.message}")

    def _rows(self, name: str, x, rows: int, width: int) -> None:
        shape = tuple(getattr(x, "shape", ()))
        if getattr(x, "dtype", None) != self.elem or shape != (rows, width):
            raise ContractError(self.WHO, "shape", f"{name} must be {self.elem.name} "
                                f"({self.dtype.value}) {(rows, width)}, not "
                                f"{getattr(x, 'dtype', type(x))} {shape}")

    def _store_calls(self, calls: Calls, sids, kv_c, k_pe, rows):
        """The store launch (none for no rows); (row counts, the tables to commit)."""
        rows = self._batch(sids, rows)
        self._rows("kv_c", kv_c, sum(rows), MLA_LATENT)
        self._rows("k_pe", k_pe, sum(rows), MLA_ROPE)
        tables = self._grown(sids, rows)
        slots = np.concatenate([self._slots(tables[sid], range(self.lengths[sid],
                                                               self.lengths[sid] + n))
                                for sid, n in zip(sids, rows, strict=True)])
        if slots.size:
            calls.add(launcher(role(Op.MLA_STORE, self.dtype), self.variants.get("store")),
                      kv_c, k_pe, self.cache, upload(slots.astype(np.int64)),
                      validate_pos=False)
        return rows, tables

    @public("MLACache.store", arrays=("kv_c", "k_pe"))
    def store(self, sids: list[int], kv_c, k_pe, rows: list[int], stream=None) -> None:
        """Append ``rows[i]`` tokens to sequence ``sids[i]`` (kv_c [sum(rows)][512] and
        k_pe [sum(rows)][64], of the cache's element type, hold them in that order)."""
        calls = Calls()
        rows, tables = self._store_calls(calls, sids, kv_c, k_pe, rows)
        calls.run(stream)
        self._commit(sids, rows, tables)

    @public("MLACache.decode", arrays=("query", "kv_c", "k_pe"))
    def decode(self, sids: list[int], query, kv_c, k_pe, scale=None,
               num_kv_splits: int = ENTRY_PARAMS["num_kv_splits"].default, lse: bool = False,
               stream=None, out_dtype: str | IoDtype | None = None):
        """Store one token per sequence (kv_c [len(sids)][512], k_pe [len(sids)][64]),
        then attend query [len(sids)][Hq][576] over each sequence at its new length (all
        of the cache's element type). Returns out [len(sids)][Hq][512] of ``out_dtype``
        (None: the cache's element type; and lse [len(sids)][Hq] f32 with ``lse=True``)."""
        self._batch(sids)
        R = len(sids)
        shape = tuple(getattr(query, "shape", ()))
        if getattr(query, "dtype", None) != self.elem or len(shape) != 3 or \
                shape[0] != R or shape[2] != MLA_ROW or shape[1] < 1:
            raise ContractError(self.WHO, "shape", f"query must be {self.elem.name} "
                                f"({self.dtype.value}) [{R}][n_head][{MLA_ROW}], not "
                                f"{getattr(query, 'dtype', type(query))} {shape}")
        if type(lse) is not bool:
            raise ContractError(self.WHO, "type", f"lse must be True or False, not {lse!r}")
        fo = self.dtype if out_dtype is None else dtype_name(out_dtype, self.WHO)
        calls = Calls()
        rows, tables = self._store_calls(calls, sids, kv_c, k_pe, [1] * R)
        lens = np.array([self.lengths[s] + 1 for s in sids], np.int32)
        out = empty((R, shape[1], MLA_LATENT), np.dtype(fo.fmt.dtype))
        lse_out = empty((R, shape[1])) if lse else None
        _decode_calls(calls, out, lse_out, query, self.cache,
                      upload(self._block_table([tables[s] for s in sids])), upload(lens),
                      scale, num_kv_splits, int(lens.max()), False,
                      (self.variants.get("decode"), self.variants.get("combine")), self.WHO)
        calls.run(stream)
        self._commit(sids, rows, tables)
        return (out.made(), lse_out.made()) if lse else out.made()

    @public("MLACache.gather")
    def gather(self, sids: list[int], starts: list[int] | None = None, stream=None):
        """Rows [starts[i], length) of each sequence ``sids[i]`` (starts: multiples of
        block_size; None: from 0), concatenated in order: [N][576] of the cache's element
        type, bit for bit."""
        self._batch(sids)
        starts = [0] * len(sids) if starts is None else self._batch(sids, starts, "starts")
        for sid, s in zip(sids, starts, strict=True):
            if s % self.block_size or s > self.lengths[sid]:
                raise ContractError(self.WHO, "seq_starts", f"start {s} of sequence {sid} "
                                    f"must be a multiple of block_size = {self.block_size} "
                                    f"within its {self.lengths[sid]} rows")
        lens = [self.lengths[sid] - s for sid, s in zip(sids, starts, strict=True)]
        n = sum(lens)
        if n == 0:
            raise ContractError(self.WHO, "shape", "the sequences hold no rows past their "
                                "starts: nothing to gather")
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        t2s = np.repeat(np.arange(len(sids), dtype=np.int32), lens)
        dst = empty((n, MLA_ROW), self.elem)
        given = any(starts)
        fn = launcher(role(Op.MLA_GATHER, self.dtype,
                           seq_starts=(SeqStarts.GIVEN if given else SeqStarts.NONE).value),
                      self.variants.get("gather"))
        arrays = (dst, self.cache, upload(self.block_table(sids)), upload(cu), upload(t2s))
        if given:
            arrays += (upload(np.array(starts, np.int32)),)
        calls = Calls()
        calls.add(fn, *arrays, num_tokens=n, validate_pos=True)  # uploads: checked on host
        calls.run(stream)
        return dst.made()
