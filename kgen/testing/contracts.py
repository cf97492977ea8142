"""Contract checks on the host: a valid argument set of NumPy arrays for each
kernel, and mutations that each break one contract, so the launchers' refusals
are tested without a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kgen import numpy_ref as ref
from kgen.ir.axes import (
    MLA_OPS,
    IoDtype,
    KStage,
    Lse,
    Mode,
    Op,
    Position,
    SeqStarts,
    Sinks,
    SoftCap,
    VStage,
    Window,
)
from kgen.ir.geometry import (
    block_threads,
    combine_staged,
    flash_shared_bytes,
    head_dim_step,
    min_head_dim,
    padded,
    query_tiles,
    stream_head_dim,
    stream_hoisted,
    tile_threads,
)
from kgen.ir.kernel import Kernel
from kgen.ir.params import INT_MAX, PARAMS
from kgen.ir.target import TARGET
from kgen.runtime.bind import bind
from kgen.runtime.contracts import ContractError
from kgen.testing.case import Case
from kgen.testing.keywords import options, prefill_outputs

_MERGE = Op.MERGE_ATTN_STATES
_DFLASH = Op.DFLASH_ATTENTION
# The attention scalars every valid flash argument set passes: the plain path.
_NEUTRAL = {name: PARAMS[name].neutral for name in ("attn_sink", "scale")}


def host_args(k: Kernel, case: Case, alloc=np.zeros) -> dict:
    """A valid argument set of NumPy arrays for ``bind`` (contents irrelevant);
    ``alloc(shape, dtype)`` makes each array."""
    z = alloc
    hd, hk, ms = case.head_dim, case.n_head_kv, case.max_seq
    f32 = np.float32
    if k.position is Position.PAGED:
        from kgen.testing.paged import host_args as paged_args

        a = paged_args(k, case, z, f32)
        if k.op is Op.FLASH:
            a.update(**_NEUTRAL, **options(k, case))
            if k.sinks is Sinks.LEARNED:
                a["sinks"] = z((case.n_head,), f32)
        a.update(_scales(k, case))
        return a
    if k.op is Op.MERGE_ATTN_STATES:
        from kgen.testing.merge import host_args as merge_args

        return merge_args(k, case, z)
    if k.op is Op.DFLASH_ATTENTION:
        from kgen.testing.dflash import host_args as dflash_args

        return dflash_args(k, case, z)
    if k.op is Op.DENSE_ATTENTION:
        from kgen.testing.dense import host_args as dense_args

        return dense_args(k, case, z)
    if k.op in MLA_OPS:
        from kgen.testing.mla import host_args as mla_args

        return mla_args(k, case, z)
    if k.op is Op.QZ_SPLIT:
        return dict(qg=z((case.n, case.n_head, 2 * hd), f32), q=z((case.n, case.n_head, hd), f32),
                    z=z((case.n, case.n_head, hd), f32))
    slots = k.position is Position.SLOTS
    ns = len(case.positions) if slots else 0
    lead = (ns, hk) if slots else (hk,)
    a: dict = {}
    if k.op in (Op.KV_APPEND, Op.FLASH):
        fmt = k.pair
        for role in ("k", "v"):  # each role's rows in its format
            f = fmt.of(role)
            row = f.row_width(hd) if fmt.accepts_head_dim(hd) else hd
            a[f"{role}_cache"] = z((*lead, ms, row), f.dtype)
        for s in fmt.shadow_buffers():
            a[s.name] = z((*lead, getattr(k, s.rows_key), hd), np.float16)
        if fmt.shadows:
            a.update(sink=case.sink, win=case.win)
        a.update(_scales(k, case))
    pos = np.array(case.positions or (case.seq_len - 1,), dtype=np.int32)
    if k.op is Op.KV_APPEND:
        rows = ns if slots else (1 if k.position is Position.DEVICE else case.n)
        a.update(k_new=z((rows, hk, hd), f32), v_new=z((rows, hk, hd), f32))
        if k.position is Position.HOST:
            a["pos0"] = case.pos0
        else:
            a["pos"] = np.array(case.positions or (case.pos0,), dtype=np.int32)
        return a
    if k.op is Op.FLASH:
        a.update(**_NEUTRAL, **options(k, case))
        if k.sinks is Sinks.LEARNED:
            a["sinks"] = z((case.n_head,), f32)
        if k.mode is Mode.PREFILL:
            a.update(q=z((case.n, case.n_head, hd), f32), pos0=case.pos0,
                     **prefill_outputs(k, case.n, case.n_head, hd, z))
            return a
        heads = case.n_head * (ns or 1)
        a["q"] = z((ns, case.n_head, hd), f32) if slots else z((case.n_head, hd), f32)
        a.update(m_out=z(heads * case.cap, f32), l_out=z(heads * case.cap, f32),
                 acc_out=z(heads * case.cap * hd, f32))
        if k.position is Position.HOST:
            plan = ref.decode_plan(case.seq_len, case.kps, case.cap)
            a.update(seq_len=case.seq_len, n_splits=plan[0], split_len=plan[1])
        else:
            a.update(pos=pos, kps=case.kps, splits_cap=case.cap)
        return a
    S = case.cap
    a.update(m_in=z(case.n_head * S, f32), l_in=z(case.n_head * S, f32),
             acc_in=z(case.n_head * S * hd, f32), out=z((case.n_head, hd), f32))
    if k.sinks is Sinks.LEARNED:
        a["sinks"] = z((case.n_head,), f32)
    if k.position is Position.HOST:
        a["n_splits"] = S
    else:
        a.update(pos=pos, kps=case.kps, splits_cap=case.cap)
    return a


# ---- contract mutations: each breaks one contract of a valid launch ---------------------

@dataclass(frozen=True)
class Mutation:
    contract: str
    applies: object  # Kernel -> bool, from the kernel's axes
    make: object     # (Kernel, Case) -> args dict breaking the contract


def _flash(k):
    return k.op is Op.FLASH


def _scales(k, case: Case) -> dict:
    """The per-tensor scales of the roles whose format has them."""
    given = {"k_scale": case.k_scale, "v_scale": case.v_scale}
    return {n: given[n] for n in k.pair.scale_scalars()}


def _cache_op(k):
    return k.op in (Op.FLASH, Op.KV_APPEND)


def _shadowed(k):
    return _cache_op(k) and k.pair.shadows


def _blocked(k):
    return _cache_op(k) and k.pair.block > 1


def _below_tile(k) -> int | None:
    """A head_dim that passes the warp and block rules but leaves keys unscored."""
    step = head_dim_step(k)
    hd = (tile_threads(k) - 1) // step * step
    while hd >= step and block_threads(k, hd) >= tile_threads(k):
        hd -= step
    return hd if hd >= step else None


def _head_dim_threads(k) -> bool:
    """A flash block sized by head_dim (not a query_tile block, sized by its tile)."""
    return _flash(k) and not query_tiles(k)


def _partial_warp(k) -> int | None:
    """A head_dim above the tile that is whole format blocks but not whole warps
    (a block of head_dim threads only)."""
    hd = -(-tile_threads(k) // TARGET.warp) * TARGET.warp + TARGET.warp // 2
    return hd if (k.pair.accepts_head_dim(hd) and not padded(k)
                  and _head_dim_threads(k)) else None


def _partial_chunk(k) -> int | None:
    """A head_dim a whole-warp block runs but its dot lanes cannot split evenly."""
    hd = min_head_dim(k) + k.dot_lanes // 2
    return hd if padded(k) and k.dot_lanes > 1 and k.pair.accepts_head_dim(hd) else None


def _over_chunk(k) -> int | None:
    """The smallest legal-looking head_dim past the register-K chunk bound."""
    step = head_dim_step(k)
    hd = (k.kreg_max_chunk * k.dot_lanes // step + 1) * step
    return hd if hd <= TARGET.max_threads else None


def _over_shared(k) -> bool:
    """A launch whose shared memory grows past a block's (a query_tile kernel's is
    bounded by max_head_dim, which the spec checks fit)."""
    return (k.k_stage is not KStage.REGISTERS and k.v_stage is VStage.GLOBAL and
            not query_tiles(k) and
            flash_shared_bytes(k, k.max_groups, TARGET.max_threads) > TARGET.shared_per_block)


def _over_tile_width(k) -> int | None:
    """query_tile: the first head_dim of whole format blocks past max_head_dim (no
    wider than a block may be threads, which is refused as such)."""
    hd = (k.max_head_dim // k.pair.block + 1) * k.pair.block
    return hd if _flash(k) and query_tiles(k) and hd <= TARGET.max_threads else None


def _args_with(**case_kw):
    return lambda k, case: host_args(k, case.with_(**case_kw))


def _set(name, value_fn):
    def make(k, case):
        a = host_args(k, case)
        a[name] = value_fn(a[name], k, case)
        return a
    return make


def _strided(a, k, case):
    wide = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), a.dtype)
    return wide[..., ::2]


def _first_array(k):
    return {Op.QZ_SPLIT: "q", Op.KV_APPEND: "k_new", Op.FLASH: "q",
            Op.DECODE_COMBINE: "out", Op.MERGE_ATTN_STATES: "output", Op.MLA_STORE: "kv_cache",
            Op.MLA_GATHER: "dst", Op.MLA_DECODE: "query", Op.MLA_COMBINE: "out",
            Op.MLA_PREFILL: "query", Op.DFLASH_ATTENTION: "query",
            Op.DENSE_ATTENTION: "query"}[k.op]


def _non_contiguous(k, case):
    a = host_args(k, case)
    name = _first_array(k)
    a[name] = _strided(a[name], k, case)
    return a


def _wrong_dtype(k, case):
    a = host_args(k, case)
    name = _first_array(k)
    a[name] = a[name].astype(np.float64)
    return a


def _decode_host(k):
    return _flash(k) and k.mode is Mode.DECODE and k.position is Position.HOST


def _pos_dev(k):
    return k.position in (Position.DEVICE, Position.SLOTS) and k.op in (Op.FLASH,
                                                                          Op.KV_APPEND)


def _paged(k):
    return k.position is Position.PAGED


class ShapeOnly:
    """An array stand-in with a shape and dtype but no storage, for launches too
    large to allocate (bind reads only shape, dtype, ndim, size and flags)."""

    class _Flags:
        c_contiguous = True

    def __init__(self, shape, dtype):
        self.shape = tuple(shape) if np.iterable(shape) else (int(shape),)
        self.dtype = np.dtype(dtype)
        self.ndim, self.size, self.flags = len(self.shape), int(np.prod(self.shape)), self._Flags()


def _shape_only(**case_kw):
    """Every array of the case replaced by a ShapeOnly of the same shape."""
    return lambda k, case: host_args(k, case.with_(**case_kw), alloc=ShapeOnly)


def _int_scalar(k) -> str | None:
    """A user-visible integer argument of the kernel, if it has one."""
    if k.op in (Op.KV_APPEND, Op.FLASH) and k.position is Position.HOST:
        return "pos0" if (k.op is Op.KV_APPEND or k.mode is Mode.PREFILL) else "seq_len"
    if k.op is Op.DFLASH_ATTENTION:
        return "sliding_window"
    if k.op is Op.DENSE_ATTENTION:
        return "block_causal"
    if k.position is Position.PAGED:
        return "kps" if k.op is Op.FLASH and k.mode is Mode.DECODE else None
    if k.position is not Position.HOST:
        return "kps" if k.op is not Op.KV_APPEND else None
    if k.op is Op.MERGE_ATTN_STATES:
        return "prefill_tokens_with_context"
    if k.op is Op.MLA_GATHER:
        return "num_tokens"
    return "n_splits" if k.op is Op.DECODE_COMBINE else None


def _not_an_integer(k, case):
    a = host_args(k, case)
    name = _int_scalar(k)
    a[name] = a[name] + 0.5
    return a


def _big_head_dim(k, case):
    hd = 2048
    return _shape_only(head_dim=hd)(k, case)


MUTATIONS: dict[str, Mutation] = {
    "not_an_array": Mutation("array", lambda k: True, lambda k, c: {
        **host_args(k, c), _first_array(k): [0.0, 1.0]}),
    "not_an_integer": Mutation("type", lambda k: _int_scalar(k) is not None, _not_an_integer),
    "scale_not_finite": Mutation("scale", _flash, lambda k, c: {
        **host_args(k, c), "scale": float("inf")}),
    "scale_overflows_float32": Mutation("scale", _flash, lambda k, c: {
        **host_args(k, c), "scale": 1e300}),
    "negative_window": Mutation("range", _flash, lambda k, c: {
        **host_args(k, c), **({"win_left": -5} if k.window is Window.EXACT
                              else {"attn_win": -5})}),
    "tensor_scale_not_positive": Mutation(
        "k_scale", lambda k: _cache_op(k) and "k_scale" in k.pair.scale_scalars(),
        lambda k, c: {**host_args(k, c), "k_scale": 0.0}),
    "softcap_not_finite": Mutation("softcap", lambda k: _flash(k) and
                                   k.softcap is SoftCap.TANH, lambda k, c: {
                                       **host_args(k, c), "softcap": float("nan")}),
    "sinks_wrong_size": Mutation("shape", lambda k: k.sinks is Sinks.LEARNED and
                                 k.op in (Op.FLASH, Op.DECODE_COMBINE), lambda k, c: {
                                     **host_args(k, c), "sinks": np.zeros(1, np.float32)}),
    "head_dim_over_block": Mutation("block size", lambda k: k.op not in (Op.QZ_SPLIT, _MERGE,
                                                                         _DFLASH, *MLA_OPS,
                                                                         Op.DENSE_ATTENTION)
                                    and not (_flash(k) and query_tiles(k))
                                    and not combine_staged(k), _big_head_dim),
    "head_dim_over_tile": Mutation(
        "head_dim range", lambda k: _over_tile_width(k) is not None,
        lambda k, c: host_args(k, c.with_(head_dim=_over_tile_width(k), n_head=2,
                                          n_head_kv=2))),
    "qtile_int32_rows": Mutation("int32 index", lambda k: _flash(k) and query_tiles(k)
                                 and not _paged(k),
                                 _shape_only(n=2**28 + 1, n_head=16, n_head_kv=2,
                                             max_seq=2**28 + 1, pos0=0)),
    "qtile_paged_int32_rows": Mutation(
        "int32 index", lambda k: _flash(k) and query_tiles(k) and _paged(k),
        _shape_only(requests=((2**28 + 1, 2**28 + 1),), n_head=16, n_head_kv=2,
                    block_size=2**20)),
    "qz_int32_index": Mutation("int32 index", lambda k: k.op is Op.QZ_SPLIT,
                               _shape_only(n=2**16, n_head=2**8, head_dim=2**8)),
    "grid_y_over_limit": Mutation("grid", lambda k: k.op is Op.KV_APPEND and
                                  k.position is not Position.SLOTS,
                                  _shape_only(n_head_kv=70000)),
    "max_seq_over_int": Mutation("max_seq", lambda k: k.op is Op.KV_APPEND and
                                 k.position is Position.HOST, _shape_only(max_seq=INT_MAX + 1)),
    "int32_position": Mutation("int32 position", lambda k: k.op is Op.KV_APPEND and
                               k.position is Position.HOST, lambda k, c: {
                                   **host_args(k, c), "pos0": INT_MAX - 1}),
    "wrong_dtype": Mutation("dtype", lambda k: True, _wrong_dtype),
    "non_contiguous": Mutation("contiguous", lambda k: True, _non_contiguous),
    "qz_shape_mismatch": Mutation("shape", lambda k: k.op is Op.QZ_SPLIT, _set(
        "z", lambda a, k, c: np.zeros((*a.shape[:-1], a.shape[-1] - 1), a.dtype))),
    "head_dim_below_tile": Mutation(
        "every key scored", lambda k: _flash(k) and _below_tile(k) is not None,
        lambda k, c: host_args(k, c.with_(head_dim=_below_tile(k)))),
    "head_dim_partial_warp": Mutation(
        "whole warps", lambda k: _flash(k) and _partial_warp(k) is not None,
        lambda k, c: host_args(k, c.with_(head_dim=_partial_warp(k)))),
    "head_dim_partial_chunk": Mutation(
        "dot chunks", lambda k: _flash(k) and _partial_chunk(k) is not None,
        lambda k, c: host_args(k, c.with_(head_dim=_partial_chunk(k)))),
    "row_format_head_dim": Mutation(
        "row format", _blocked,
        lambda k, c: host_args(k, c.with_(head_dim=k.pair.block + k.pair.block // 2))),
    "kv_groups_over_max": Mutation("kv_groups", _flash, lambda k, c: host_args(
        k, c.with_(n_head=2 * (k.max_groups + 1), n_head_kv=2))),
    "gqa_mismatch": Mutation("GQA", _flash, _args_with(n_head=7, n_head_kv=2)),
    "shared_memory": Mutation("shared memory", lambda k: _flash(k) and _over_shared(k),
                              lambda k, c: host_args(k, c.with_(
                                  head_dim=TARGET.max_threads, n_head=k.max_groups,
                                  n_head_kv=1))),
    "register_k_chunk": Mutation("register K chunk", lambda k: _flash(k) and k.k_stage is
                                 KStage.REGISTERS and _over_chunk(k) is not None
                                 and not stream_hoisted(k),
                                 lambda k, c: host_args(k, c.with_(
                                     head_dim=_over_chunk(k), n_head=2, n_head_kv=2))),
    "hoisted_chunk": Mutation("hoisted chunk", lambda k: _flash(k) and stream_hoisted(k),
                              lambda k, c: host_args(k, c.with_(
                                  head_dim=stream_head_dim(k) - head_dim_step(k)))),
    "prefill_ring_wrap": Mutation("no ring wrap", lambda k: _flash(k) and k.mode is
                                  Mode.PREFILL and not _paged(k), lambda k, c: host_args(
                                      k, c.with_(pos0=c.max_seq - c.n + 1))),
    "negative_pos0": Mutation("range", lambda k: k.position is Position.HOST and
                              (k.op is Op.KV_APPEND or (_flash(k) and k.mode is Mode.PREFILL)),
                              _args_with(pos0=-1)),
    "sink_rows": Mutation("sink rows", _shadowed, lambda k, c: host_args(
        k, c.with_(sink=k.sink_rows + 1))),
    "window_ring": Mutation("window ring", _shadowed, lambda k, c: host_args(
        k, c.with_(win=k.ring_rows + 1))),
    "append_ring_race": Mutation(
        "ring write race", lambda k: k.op is Op.KV_APPEND and k.position is Position.HOST,
        lambda k, c: host_args(k, c.with_(
            n=(k.ring_rows if k.pair.shadows else c.max_seq) + 1, pos0=0,
            win=min(8, k.ring_rows),
            max_seq=(4 * k.ring_rows if k.pair.shadows else c.max_seq)))),
    "device_append_rows": Mutation(
        "one decode row", lambda k: k.op is Op.KV_APPEND and k.position is Position.DEVICE,
        lambda k, c: {**host_args(k, c), "k_new": np.zeros((2, c.n_head_kv, c.head_dim),
                                                           np.float32),
                      "v_new": np.zeros((2, c.n_head_kv, c.head_dim), np.float32)}),
    "decode_past_max_seq": Mutation("no ring wrap", _decode_host, lambda k, c: {
        **host_args(k, c), "seq_len": c.max_seq + 1}),
    "decode_bad_plan": Mutation("split plan", _decode_host, lambda k, c: {
        **host_args(k, c), "n_splits": host_args(k, c)["n_splits"] + 1}),
    "split_len_not_tiles": Mutation("split plan", _decode_host, lambda k, c: {
        **host_args(k, c), "split_len": k.tile_keys + 1}),
    "negative_device_pos": Mutation("position", _pos_dev, _set(
        "pos", lambda a, k, c: np.full_like(a, -1))),
    "device_pos_past_max_seq": Mutation(
        "no ring wrap", lambda k: _pos_dev(k) and (_flash(k) or not k.pair.append_wraps),
        _set("pos", lambda a, k, c: np.full_like(a, c.max_seq))),
    "slots_launch_too_narrow": Mutation(
        "slot plan coverage", lambda k: _flash(k) and k.position is Position.SLOTS,
        lambda k, c: {**host_args(k, c), "launch_splits": 1}),
    "paged_seq_len_past_table": Mutation("seq_lens", lambda k: _paged(k) and _flash(k),
                                         _set("seq_lens", lambda a, k, c: a + 10**6)),
    "paged_block_outside_pages": Mutation("block_table", lambda k: _paged(k) and _flash(k),
                                          _set("block_table", lambda a, k, c: a + 10**6)),
    "paged_query_rows_mismatch": Mutation(
        "query_start_loc", lambda k: _paged(k) and _flash(k) and k.mode is Mode.PREFILL,
        _set("query_start_loc", lambda a, k, c: a * 2)),
    "paged_max_query_len_too_small": Mutation(
        "max_query_len", lambda k: _paged(k) and _flash(k) and k.mode is Mode.PREFILL,
        lambda k, c: {**host_args(k, c), "max_query_len": max(q for q, _ in c.requests) - 1}),
    "paged_max_query_len_over_rows": Mutation(
        "max_query_len", lambda k: _paged(k) and _flash(k) and k.mode is Mode.PREFILL,
        lambda k, c: {**host_args(k, c), "max_query_len": sum(q for q, _ in c.requests) + 1}),
    "paged_max_seq_len_too_small": Mutation(
        "max_seq_len", lambda k: _paged(k) and _flash(k) and k.mode is Mode.DECODE,
        lambda k, c: {**host_args(k, c), "max_seq_len": 1}),
    "paged_slot_collision": Mutation(
        "slot_mapping", lambda k: _paged(k) and k.op is Op.KV_APPEND,
        _set("slot_mapping", lambda a, k, c: np.zeros_like(a))),
    "paged_slot_past_pages": Mutation(
        "slot_mapping", lambda k: _paged(k) and k.op is Op.KV_APPEND,
        _set("slot_mapping", lambda a, k, c: a + 10**6)),
    "partials_too_small": Mutation(
        "partials size", lambda k: (_flash(k) and k.mode is Mode.DECODE) or
        k.op is Op.DECODE_COMBINE,
        lambda k, c: {**host_args(k, c), **({"acc_out": np.zeros(8, np.float32)} if _flash(k)
                                            else {"acc_in": np.zeros(8, np.float32)})}),
}


# ---- merge_attn_states: outputs [T][H][Dv] alike, LSEs [H][T] ---------------------------

def _merging(k):
    return k.op is _MERGE


def _merge_set(name, value_fn, **case_kw):
    """The merge's arguments (at ``case_kw``, a case with n_tokens != n_head, so a
    transposed LSE is told apart) with ``name`` replaced by value_fn(its array, case)."""
    def make(k, case):
        c = case.with_(**{"n": 5, "n_head": 3, **case_kw})
        a = host_args(k, c)
        a[name] = value_fn(a[name], c)
        return a
    return make


def _transposed(a, c):
    return np.zeros(a.shape[::-1], a.dtype)


MUTATIONS.update({
    "merge_prefix_lse_transposed": Mutation("lse layout", _merging, _merge_set(
        "prefix_lse", _transposed)),
    "merge_suffix_lse_transposed": Mutation("lse layout", _merging, _merge_set(
        "suffix_lse", _transposed)),
    "merge_output_lse_transposed": Mutation(
        "lse layout", lambda k: _merging(k) and k.lse is Lse.WRITE,
        _merge_set("output_lse", _transposed)),
    "merge_lse_flat": Mutation("shape", _merging, _merge_set(
        "prefix_lse", lambda a, c: np.zeros(a.size, a.dtype))),
    "merge_lse_tokens_mismatch": Mutation("lse layout", _merging, _merge_set(
        "suffix_lse", lambda a, c: np.zeros((a.shape[0], a.shape[1] + 1), a.dtype))),
    "merge_suffix_elem": Mutation("dtype", _merging, _merge_set(
        "suffix_output", lambda a, c: _other_elem(a, c))),
    "merge_output_elem": Mutation("dtype", _merging, _merge_set(
        "output", lambda a, c: _other_elem(a, c))),
    "merge_lse_dtype": Mutation("dtype", _merging, _merge_set(
        "suffix_lse", lambda a, c: a.astype(np.float64))),
    "merge_lse_non_contiguous": Mutation("contiguous", _merging, _merge_set(
        "prefix_lse", lambda a, c: np.zeros((a.shape[0], 2 * a.shape[1]), a.dtype)[:, ::2])),
    "merge_output_lse_dtype": Mutation(
        "dtype", lambda k: _merging(k) and k.lse is Lse.WRITE,
        _merge_set("output_lse", lambda a, c: a.astype(np.float16))),
    "merge_head_dim_mismatch": Mutation("shape", _merging, _merge_set(
        "suffix_output", lambda a, c: np.zeros((*a.shape[:2], a.shape[2] + 1), a.dtype))),
    "merge_tokens_mismatch": Mutation("shape", _merging, _merge_set(
        "prefix_output", lambda a, c: np.zeros((a.shape[0] + 1, *a.shape[1:]), a.dtype))),
    "merge_heads_mismatch": Mutation("shape", _merging, _merge_set(
        "prefix_output", lambda a, c: np.zeros((a.shape[0], a.shape[1] + 1, a.shape[2]),
                                               a.dtype))),
    "merge_suffix_non_contiguous": Mutation("contiguous", _merging, _merge_set(
        "suffix_output", lambda a, c: _strided(a, None, c))),
    "merge_suffix_not_an_array": Mutation("array", _merging, _merge_set(
        "suffix_output", lambda a, c: a.tolist())),
    "merge_no_tokens": Mutation("shape", _merging, _args_with(n=0)),
    "merge_int32_rows": Mutation("int32 index", _merging, lambda k, c: host_args(
        k, c.with_(n=2**27, n_head=16, head_dim=1), alloc=ShapeOnly)),
    "merge_prefill_tokens_over_int": Mutation("range", _merging, lambda k, c: {
        **host_args(k, c), "prefill_tokens_with_context": INT_MAX + 1}),
})


# ---- multi-head latent attention: the latent pages [nb][bs][576], device index tensors --

def _mla(op):
    return lambda k: k.op is op


def _mla_set(name, value_fn, **case_kw):
    """The kernel's arguments (at ``case_kw``) with ``name`` replaced by value_fn(its
    value, the arguments)."""
    def make(k, case):
        a = host_args(k, case.with_(**case_kw))
        a[name] = value_fn(a[name], a)
        return a
    return make


def _zeros_like_shape(shape_fn):
    return lambda x, a: np.zeros(shape_fn(tuple(x.shape)), x.dtype)


def _mla_shape_only(**case_kw):
    return lambda k, case: host_args(k, case.with_(**case_kw), alloc=ShapeOnly)


def _other_elem(x, a):
    """The same shape in another element type (kgen.ir.axes.IoDtype) than ``x``'s."""
    other = next(d for d in IoDtype if np.dtype(d.fmt.dtype) != x.dtype)
    return np.zeros(x.shape, np.dtype(other.fmt.dtype))


def _huge_pages(x, a):
    return ShapeOnly((2**20, 2**12, x.shape[2]), x.dtype)


_STORE, _GATHER, _DECODE, _COMBINE = (_mla(o) for o in (Op.MLA_STORE, Op.MLA_GATHER,
                                                       Op.MLA_DECODE, Op.MLA_COMBINE))
_PREFILL = _mla(Op.MLA_PREFILL)
_MLA_DECODING = lambda k: k.op in (Op.MLA_DECODE, Op.MLA_COMBINE)  # noqa: E731

MUTATIONS.update({
    "mla_store_pe_rows_mismatch": Mutation("shape", _STORE, _mla_set(
        "k_pe", _zeros_like_shape(lambda s: (s[0] + 1, s[1])))),
    "mla_store_kv_c_width": Mutation("shape", _STORE, _mla_set(
        "kv_c", _zeros_like_shape(lambda s: (s[0], s[1] - 1)))),
    "mla_store_kv_c_column_strided": Mutation("contiguous", _STORE, _mla_set(
        "kv_c", lambda x, a: np.zeros((x.shape[0], 2 * x.shape[1]), x.dtype)[:, ::2])),
    "mla_store_k_pe_dtype": Mutation("dtype", _STORE, _mla_set(
        "k_pe", lambda x, a: x.astype(np.float64))),
    # one element type per role (in_dtype: rows, cache, queries, q/K/V; out_dtype: out)
    "mla_store_cache_elem": Mutation("dtype", _STORE, _mla_set("kv_cache", _other_elem)),
    "mla_gather_dst_elem": Mutation("dtype", _GATHER, _mla_set("dst", _other_elem)),
    "mla_decode_query_elem": Mutation("dtype", _DECODE, _mla_set("query", _other_elem)),
    "mla_combine_out_elem": Mutation("dtype", _COMBINE, _mla_set("out", _other_elem)),
    "mla_prefill_value_elem": Mutation("dtype", _PREFILL, _mla_set("value", _other_elem)),
    "mla_prefill_out_elem": Mutation("dtype", _PREFILL, _mla_set("out", _other_elem)),
    "mla_store_slots_over_tokens": Mutation("shape", _STORE, _mla_set(
        "slot_mapping", lambda x, a: np.arange(x.size + 1, dtype=np.int64))),
    "mla_store_slots_int32": Mutation("dtype", _STORE, _mla_set(
        "slot_mapping", lambda x, a: x.astype(np.int32))),
    "mla_store_cache_width": Mutation("shape", _STORE, _mla_set(
        "kv_cache", _zeros_like_shape(lambda s: (s[0], s[1], s[2] - 64)))),
    "mla_store_positions_overflow": Mutation("int32 position", _STORE, _mla_set(
        "kv_cache", _huge_pages)),
    "mla_store_slot_past_pages": Mutation("slot_mapping", _STORE, _mla_set(
        "slot_mapping", lambda x, a: x + 10**6)),
    "mla_store_slot_collision": Mutation("slot_mapping", _STORE, _mla_set(
        "slot_mapping", lambda x, a: np.zeros_like(x), n=3)),
    "mla_gather_tokens_over_dst": Mutation("shape", _GATHER, _mla_set(
        "num_tokens", lambda x, a: x + 1)),
    "mla_gather_tokens_over_map": Mutation("shape", _GATHER, _mla_set(
        "token_to_seq", lambda x, a: x[:-1].copy())),
    "mla_gather_no_tokens": Mutation("range", _GATHER, _mla_set("num_tokens", lambda x, a: 0)),
    "mla_gather_cu_size": Mutation("shape", _GATHER, _mla_set(
        "cu_seq_lens", lambda x, a: x[:-1].copy())),
    "mla_gather_dst_width": Mutation("shape", _GATHER, _mla_set(
        "dst", _zeros_like_shape(lambda s: (s[0], s[1] + 1)))),
    "mla_gather_src_rank": Mutation("shape", _GATHER, _mla_set(
        "src_cache", _zeros_like_shape(lambda s: (s[0], s[1], 1, s[2])))),
    "mla_gather_table_int64": Mutation("dtype", _GATHER, _mla_set(
        "block_table", lambda x, a: x.astype(np.int64))),
    "mla_gather_starts_size": Mutation(
        "shape", lambda k: _GATHER(k) and k.seq_starts is SeqStarts.GIVEN,
        _mla_set("seq_starts", lambda x, a: np.zeros(x.size + 1, x.dtype))),
    "mla_gather_start_not_block": Mutation(
        "seq_starts", lambda k: _GATHER(k) and k.seq_starts is SeqStarts.GIVEN,
        _mla_set("seq_starts", lambda x, a: x + 1, requests=((2, 9),), block_size=4)),
    "mla_gather_token_wrong_seq": Mutation("token_to_seq", _GATHER, _mla_set(
        "token_to_seq", lambda x, a: x[::-1].copy(), requests=((2, 2), (1, 1)))),
    "mla_gather_cu_not_rising": Mutation("cu_seq_lens", _GATHER, _mla_set(
        "cu_seq_lens", lambda x, a: x + 1)),
    "mla_gather_block_outside": Mutation("block_table", _GATHER, _mla_set(
        "block_table", lambda x, a: x + 10**6)),
    "mla_gather_row_past_table": Mutation("block_table", _GATHER, _mla_set(
        "block_table", lambda x, a: x[:, :1].copy(), requests=((3, 3),), block_size=2)),
    "mla_decode_query_width": Mutation("shape", _DECODE, _mla_set(
        "query", _zeros_like_shape(lambda s: (s[0], s[1], s[2] - 64)))),
    "mla_decode_table_rows": Mutation("shape", _DECODE, _mla_set(
        "block_table", _zeros_like_shape(lambda s: (s[0] + 1, s[1])))),
    "mla_decode_cache_width": Mutation("shape", _DECODE, _mla_set(
        "kv_cache", _zeros_like_shape(lambda s: (s[0], s[1], s[2] + 1)))),
    "mla_decode_positions_overflow": Mutation("int32 position", _DECODE, _mla_set(
        "kv_cache", _huge_pages)),
    "mla_decode_scale_not_finite": Mutation("scale", _DECODE, _mla_set(
        "scale", lambda x, a: float("inf"))),
    "mla_decode_scale_not_positive": Mutation("scale", _DECODE, _mla_set(
        "scale", lambda x, a: 0.0)),
    "mla_decode_seq_len_zero": Mutation("seq_lens", _DECODE, _mla_set(
        "seq_lens", lambda x, a: np.zeros_like(x))),
    "mla_decode_seq_past_table": Mutation("block_table", _DECODE, _mla_set(
        "seq_lens", lambda x, a: x + 10**6)),
    "mla_decode_block_outside": Mutation("block_table", _DECODE, _mla_set(
        "block_table", lambda x, a: x + 10**6)),
    "mla_decode_splits_over_grid": Mutation("grid", _DECODE, _mla_shape_only(
        n_splits=2**16)),
    "mla_partials_heads": Mutation("shape", _MLA_DECODING, lambda k, c: _mla_set(
        "m_out" if _DECODE(k) else "m_in", _zeros_like_shape(
            lambda s: (s[0], s[1] + 1, s[2])))(k, c)),
    "mla_partials_l_splits": Mutation("shape", _MLA_DECODING, lambda k, c: _mla_set(
        "l_out" if _DECODE(k) else "l_in", _zeros_like_shape(
            lambda s: (s[0], s[1], s[2] + 1)))(k, c)),
    "mla_partials_acc_width": Mutation("shape", _MLA_DECODING, lambda k, c: _mla_set(
        "acc_out" if _DECODE(k) else "acc_in", _zeros_like_shape(
            lambda s: (*s[:3], s[3] + 64)))(k, c)),
    "mla_partials_flat": Mutation("shape", _MLA_DECODING, lambda k, c: _mla_set(
        "m_out" if _DECODE(k) else "m_in", lambda x, a: np.zeros(x.size, x.dtype))(k, c)),
    "mla_seq_lens_size": Mutation("shape", _MLA_DECODING, _mla_set(
        "seq_lens", lambda x, a: np.zeros(x.size + 1, x.dtype))),
    "mla_combine_out_width": Mutation("shape", _COMBINE, _mla_set(
        "out", _zeros_like_shape(lambda s: (s[0], s[1], s[2] + 64)))),
    "mla_combine_lse_layout": Mutation(
        "shape", lambda k: _COMBINE(k) and k.lse is Lse.WRITE,
        _mla_set("lse", _zeros_like_shape(lambda s: s[::-1]), n_head=3)),
    "mla_combine_seq_len_zero": Mutation("seq_lens", _COMBINE, _mla_set(
        "seq_lens", lambda x, a: np.zeros_like(x))),
    "mla_combine_rows_over_int": Mutation("int32 index", _COMBINE, _mla_shape_only(
        requests=((1, 1),) * 2**16, n_head=2**15, n_splits=1)),
    "mla_prefill_key_width": Mutation("shape", _PREFILL, _mla_set(
        "key", _zeros_like_shape(lambda s: (s[0], s[1], s[2] - 64)))),
    "mla_prefill_value_rows": Mutation("shape", _PREFILL, _mla_set(
        "value", _zeros_like_shape(lambda s: (s[0] + 1, s[1], s[2])))),
    "mla_prefill_heads_mismatch": Mutation("shape", _PREFILL, _mla_set(
        "key", _zeros_like_shape(lambda s: (s[0], s[1] + 1, s[2])))),
    "mla_prefill_out_width": Mutation("shape", _PREFILL, _mla_set(
        "out", _zeros_like_shape(lambda s: (s[0], s[1], s[2] + 64)))),
    "mla_prefill_cu_k_size": Mutation("shape", _PREFILL, _mla_set(
        "cu_seqlens_k", lambda x, a: np.zeros(x.size + 1, x.dtype))),
    "mla_prefill_lse_transposed": Mutation(
        "lse layout", lambda k: _PREFILL(k) and k.lse is Lse.WRITE,
        _mla_set("lse", _zeros_like_shape(lambda s: s[::-1]), requests=((5, 5),), n_head=3)),
    "mla_prefill_max_seqlen_q_over_rows": Mutation("max_seqlen_q", _PREFILL, _mla_set(
        "max_seqlen_q", lambda x, a: int(a["query"].shape[0]) + 1)),
    "mla_prefill_max_seqlen_q_short": Mutation("max_seqlen_q", _PREFILL, _mla_set(
        "max_seqlen_q", lambda x, a: x - 1, requests=((1, 1), (3, 3)))),
    "mla_prefill_cu_q_not_rising": Mutation("cu_seqlens_q", _PREFILL, _mla_set(
        "cu_seqlens_q", lambda x, a: x[::-1].copy(), requests=((1, 1), (3, 3)))),
    "mla_prefill_cu_k_past_rows": Mutation("cu_seqlens_k", _PREFILL, _mla_set(
        "cu_seqlens_k", lambda x, a: x * 2)),
    "mla_prefill_rows_over_int": Mutation("int32 index", _PREFILL, _mla_shape_only(
        requests=((2**16, 2**16),), n_head=2**15 + 1)),
    "mla_prefill_scale_not_finite": Mutation("scale", _PREFILL, _mla_set(
        "scale", lambda x, a: float("nan"))),
})


# ---- dflash_attention: query / out [T][H][D], keys [T][Hkv][D] (paged: and pages) -------

def _dflashing(k):
    return k.op is _DFLASH


def _dflash_paged(k):
    from kgen.testing.dflash import paged

    return _dflashing(k) and paged(k)


def _dflash_keys(k):
    from kgen.testing.dflash import paged

    return ("block_key", "block_value") if paged(k) else ("key", "value")


def _dflash_set(name, value_fn, **case_kw):
    """The dflash arguments (at ``case_kw``) with ``name`` (a callable of the kernel:
    its name) replaced by value_fn(its array, case)."""
    def make(k, case):
        c = case.with_(**case_kw)
        a = host_args(k, c)
        n = name(k) if callable(name) else name
        a[n] = value_fn(a[n], c)
        return a
    return make


def _grown(axis, by=1):
    def grow(a, c):
        shape = list(a.shape)
        shape[axis] += by
        return np.zeros(shape, a.dtype)
    return grow


MUTATIONS.update({
    "dflash_head_dim_over_max": Mutation("head_dim range", _dflashing, lambda k, c: host_args(
        k, c.with_(head_dim=k.max_head_dim + 1))),
    "dflash_gqa_mismatch": Mutation("GQA", _dflashing, _args_with(n_head=7, n_head_kv=2)),
    "dflash_out_shape": Mutation("shape", _dflashing, _dflash_set("out", _grown(1))),
    "dflash_key_rows_mismatch": Mutation("shape", _dflashing, _dflash_set(
        lambda k: _dflash_keys(k)[0], _grown(0))),
    "dflash_value_heads_mismatch": Mutation("shape", _dflashing, _dflash_set(
        lambda k: _dflash_keys(k)[1], _grown(1))),
    "dflash_key_head_dim_mismatch": Mutation("shape", _dflashing, _dflash_set(
        lambda k: _dflash_keys(k)[0], _grown(2))),
    # one element type for query and every key / value array (in_dtype), out's own
    "dflash_key_elem": Mutation("dtype", _dflashing, _dflash_set(
        lambda k: _dflash_keys(k)[0], _other_elem)),
    "dflash_value_elem": Mutation("dtype", _dflashing, _dflash_set(
        lambda k: _dflash_keys(k)[1], _other_elem)),
    "dflash_query_elem": Mutation("dtype", _dflashing, _dflash_set("query", _other_elem)),
    "dflash_out_elem": Mutation("dtype", _dflashing, _dflash_set("out", _other_elem)),
    "dflash_ctx_value_elem": Mutation("dtype", _dflash_paged, _dflash_set(
        "ctx_value", _other_elem)),
    "dflash_cu_seqlens_dtype": Mutation("dtype", _dflashing, _dflash_set(
        "cu_seqlens", lambda a, c: a.astype(np.int64))),
    "dflash_cu_seqlens_2d": Mutation("shape", _dflashing, _dflash_set(
        "cu_seqlens", lambda a, c: a.reshape(1, -1))),
    "dflash_no_requests": Mutation("shape", _dflashing, _dflash_set(
        "cu_seqlens", lambda a, c: a[:1].copy())),
    "dflash_causal_range": Mutation("range", _dflashing, lambda k, c: {
        **host_args(k, c), "block_causal": 2}),
    "dflash_window_over_int": Mutation("range", _dflashing, lambda k, c: {
        **host_args(k, c), "sliding_window": INT_MAX + 1}),
    "dflash_scale_not_finite": Mutation("scale", _dflashing, lambda k, c: {
        **host_args(k, c), "scale": float("inf")}),
    "dflash_scale_not_positive": Mutation("scale", _dflashing, lambda k, c: {
        **host_args(k, c), "scale": 0.0}),
    "dflash_int32_rows": Mutation("int32 index", _dflashing, lambda k, c: host_args(
        k, c.with_(requests=((2**27, 0),), n_head=16, n_head_kv=16, head_dim=1),
        alloc=ShapeOnly)),
    "dflash_ctx_pages_mismatch": Mutation("shape", _dflash_paged, _dflash_set(
        "ctx_value", _grown(1))),
    "dflash_ctx_heads_mismatch": Mutation("shape", _dflash_paged, _dflash_set(
        "ctx_key", _grown(2))),
    "dflash_seq_lens_size": Mutation("shape", _dflash_paged, _dflash_set(
        "seq_lens", _grown(0))),
    "dflash_block_table_rows": Mutation("shape", _dflash_paged, _dflash_set(
        "block_table", _grown(0))),
    "dflash_block_table_no_columns": Mutation("shape", _dflash_paged, _dflash_set(
        "block_table", lambda a, c: np.zeros((a.shape[0], 0), a.dtype))),
    "dflash_block_table_dtype": Mutation("dtype", _dflash_paged, _dflash_set(
        "block_table", lambda a, c: a.astype(np.int64))),
    "dflash_pages_int32_position": Mutation("int32 position", _dflash_paged, lambda k, c: {
        **host_args(k, c), **{n: ShapeOnly((2**20, 2**12, c.n_head_kv, c.head_dim),
                                           np.dtype(k.in_dtype.fmt.dtype))
                              for n in ("ctx_key", "ctx_value")}}),
    "dflash_table_int32_position": Mutation("int32 position", _dflash_paged, _dflash_set(
        "block_table", lambda a, c: ShapeOnly((a.shape[0], 2**31 // c.block_size),
                                              a.dtype))),
})


# ---- dense_attention: query / out [T][H][D], key / value [T][Hkv][D] -------------------

def _dense(k):
    return k.op is Op.DENSE_ATTENTION


def _other_dtype(a, c):
    """The same shape in the element type the kernel does not take (f32 <-> bf16)."""
    return np.zeros(a.shape, np.uint16 if a.dtype == np.float32 else np.float32)


MUTATIONS.update({
    "dense_head_dim_over_max": Mutation("head_dim range", _dense, lambda k, c: host_args(
        k, c.with_(head_dim=k.max_head_dim + 1))),
    "dense_gqa_mismatch": Mutation("GQA", _dense, _args_with(n_head=7, n_head_kv=2)),
    "dense_out_shape": Mutation("shape", _dense, _dflash_set("out", _grown(1))),
    "dense_out_rows": Mutation("shape", _dense, _dflash_set("out", _grown(0))),
    "dense_key_rows_mismatch": Mutation("shape", _dense, _dflash_set("key", _grown(0))),
    "dense_value_heads_mismatch": Mutation("shape", _dense, _dflash_set("value", _grown(1))),
    "dense_key_head_dim_mismatch": Mutation("shape", _dense, _dflash_set("key", _grown(2))),
    "dense_no_kv_heads": Mutation("shape", _dense, _dflash_set(
        "key", lambda a, c: np.zeros((a.shape[0], 0, a.shape[2]), a.dtype))),
    "dense_query_2d": Mutation("shape", _dense, _dflash_set(
        "query", lambda a, c: a.reshape(a.shape[0], -1))),
    "dense_no_rows": Mutation("shape", _dense, _dflash_set(
        "query", lambda a, c: a[:0].copy())),
    "dense_key_dtype": Mutation("dtype", _dense, _dflash_set("key", _other_dtype)),
    "dense_value_dtype": Mutation("dtype", _dense, _dflash_set("value", _other_dtype)),
    "dense_out_dtype": Mutation("dtype", _dense, _dflash_set("out", _other_dtype)),
    "dense_causal_range": Mutation("range", _dense, lambda k, c: {
        **host_args(k, c), "block_causal": 2}),
    "dense_scale_not_finite": Mutation("scale", _dense, lambda k, c: {
        **host_args(k, c), "scale": float("nan")}),
    "dense_scale_not_positive": Mutation("scale", _dense, lambda k, c: {
        **host_args(k, c), "scale": -1.0}),
    "dense_int32_rows": Mutation("int32 index", _dense, lambda k, c: host_args(
        k, c.with_(n=2**27, n_head=16, n_head_kv=16, head_dim=1), alloc=ShapeOnly)),
})


def mutations_for(k: Kernel) -> list[str]:
    return [name for name, m in MUTATIONS.items() if m.applies(k)]


def check_mutation(k: Kernel, case: Case, mutation: str) -> None:
    """The case binds; the mutated arguments raise the mutation's contract."""
    m = MUTATIONS[mutation]
    bind(k, host_args(k, case))
    try:
        bind(k, m.make(k, case))
    except ContractError as exc:
        assert exc.contract == m.contract, f"{mutation}: expected contract {m.contract!r}, " \
                                           f"got {exc}"
        return
    raise AssertionError(f"{k.name}: {mutation} (breaks {m.contract!r}) was accepted")
