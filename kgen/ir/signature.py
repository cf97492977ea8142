"""Kernel parameter lists, derived from a kernel's axes.

The templates render these and the Python launchers bind to them, so the two
cannot disagree about a kernel's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from kgen.formats.base import ROLES
from kgen.ir.axes import (
    KeySource,
    KeySplit,
    Lse,
    Mode,
    Op,
    Position,
    Schedule,
    SeqStarts,
    Sinks,
    SoftCap,
    Window,
)
from kgen.ir.kernel import Kernel

# NumPy dtypes of the element types of the arrays every kernel of an op takes; a KV
# cache array's elements are its format's (``KvFormat.ctype``, ``KvFormat.dtype``).
ELEMENT_DTYPES = {"float": "float32", "__half": "float16", "int": "int32",
                  "long long": "int64"}


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # e.g. "const float *", "int"
    dtype: str | None = None  # a pointer's NumPy element dtype (what the launcher checks)

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")

    @property
    def decl(self) -> str:
        sep = "" if self.is_pointer else " "
        return f"{self.ctype}{sep}{self.name}"


def _p(ctype: str, *names: str) -> list[Param]:
    """Parameters of a fixed C type (an array's elements in ``ELEMENT_DTYPES``)."""
    element = ctype.removeprefix("const ").removesuffix("*").rstrip()
    dtype = ELEMENT_DTYPES[element] if ctype.endswith("*") else None
    return [Param(n, ctype, dtype) for n in names]


def _cache(k: Kernel, const: str) -> list[Param]:
    """The K and V cache arrays: rows of each role's format."""
    return [Param(f"{r}_cache", f"{const}{k.pair.of(r).ctype} *", k.pair.of(r).dtype)
            for r in ROLES]


def _elems(dtype, const: str, *names: str) -> list[Param]:
    """Arrays of an op's element type (``in_dtype`` / ``out_dtype``: a plain-element
    format's C and NumPy types)."""
    fmt = dtype.fmt
    return [Param(n, f"{const}{fmt.ctype} *", fmt.dtype) for n in names]


def _position(k: Kernel, host: list[Param]) -> list[Param]:
    if k.position is Position.HOST:
        return host
    return _p("const int *", "pos")


_PARAMS: dict[int, tuple[Kernel, tuple[Param, ...]]] = {}


def params(k: Kernel) -> tuple[Param, ...]:
    """The kernel's parameter list (memoised per kernel object: launches ask often)."""
    hit = _PARAMS.get(id(k))
    if hit is not None and hit[0] is k:
        return hit[1]
    out = _params(k)
    _PARAMS[id(k)] = (k, out)
    return out


def _params(k: Kernel) -> tuple[Param, ...]:
    out: list[Param] = []
    fmt = k.pair  # the cache's formats: shadows and scales of the roles that keep them
    shadows = [s.name for s in fmt.shadow_buffers()]
    shadow_scalars = list(fmt.shadow_scalars())
    scales = list(fmt.scale_scalars())
    if k.op is Op.QZ_SPLIT:
        out += _p("const float *", "qg") + _p("float *", "q", "z") + _p("int", "head_dim", "total")
    elif k.op is Op.KV_APPEND:
        out += _p("const float *", "k_new", "v_new")
        out += _cache(k, "")
        out += _p("__half *", *shadows)
        if k.position is Position.PAGED:  # reshape_and_cache
            out += _p("const int *", "slot_mapping") + _p("int", "n_head_kv", "head_dim")
        else:
            out += _p("int", "n_head_kv", "head_dim", "max_seq")
            out += _position(k, _p("int", "pos0"))
        out += _p("int", *shadow_scalars)
        out += _p("float", *scales)
    elif k.op is Op.FLASH:
        out += _p("const float *", "q")
        out += _cache(k, "const ")
        out += _p("const __half *", *shadows)
        if k.mode is Mode.PREFILL:
            out += _p("float *", *(("m_out", "l_out", "acc_out")
                                   if k.key_split is KeySplit.PARTIALS else ("out",)))
            if k.sinks is Sinks.LEARNED:
                out += _p("const float *", "sinks")
        else:
            out += _p("float *", "m_out", "l_out", "acc_out")
        if k.position is Position.PAGED:
            out += _p("const int *", "block_table", "seq_lens")
            if k.mode is Mode.PREFILL:
                out += _p("const int *", "query_start_loc")
            out += _p("int", "kv_groups", "head_dim", "block_size", "max_blocks")
            out += _p("int", "num_reqs") if k.mode is Mode.PREFILL else \
                _p("int", "kps", "splits_cap")
            if k.key_split is KeySplit.PARTIALS:
                out += _p("int", "n_splits")
        elif k.mode is Mode.PREFILL:
            out += _p("int", "kv_groups", "head_dim", "max_seq")
            out += _p("int", "pos0")
            if k.rows_per_block > 1 or k.schedule is Schedule.QUERY_TILE:
                out += _p("int", "n_rows")
            if k.key_split is KeySplit.PARTIALS:
                out += _p("int", "n_splits")
        else:
            out += _p("int", "kv_groups", "head_dim", "max_seq")
            out += _position(k, _p("int", "seq_len", "n_splits", "split_len"))
            if k.position is not Position.HOST:
                out += _p("int", "kps", "splits_cap")
        out += _p("int", *shadow_scalars)
        out += _p("float", *scales)
        if k.window is Window.EXACT:
            out += _p("int", "attn_sink", "win_left", "win_right")
        else:
            out += _p("int", "attn_sink", "attn_win")
        out += _p("float", "scale")
        if k.softcap is SoftCap.TANH:
            out += _p("float", "softcap")
    elif k.op is Op.DECODE_COMBINE:
        out += _p("const float *", "m_in", "l_in", "acc_in") + _p("float *", "out")
        if k.sinks is Sinks.LEARNED:
            out += _p("const float *", "sinks")
        out += _p("int", "head_dim")
        out += _position(k, _p("int", "n_splits"))
        if k.position is not Position.HOST:
            out += _p("int", "kps", "splits_cap")
    elif k.op is Op.MERGE_ATTN_STATES:  # the engine's argument order and names
        out += _elems(k.out_dtype, "", "output") + _p("float *", *(["output_lse"]
                                                                 if k.lse is Lse.WRITE else []))
        out += _elems(k.in_dtype, "const ", "prefix_output") + _p("const float *", "prefix_lse")
        out += _elems(k.in_dtype, "const ", "suffix_output") + _p("const float *", "suffix_lse")
        out += _p("int", "n_tokens", "n_head", "head_dim", "prefill_tokens_with_context")
    elif k.op is Op.MLA_STORE:  # the engine's ConcatAndCacheMla; row strides in elements
        out += _elems(k.in_dtype, "const ", "kv_c", "k_pe") + _elems(k.in_dtype, "", "kv_cache")
        out += _p("const long long *", "slot_mapping")
        out += _p("int", "n_slots", "kv_c_stride", "k_pe_stride", "num_blocks", "block_size")
    elif k.op is Op.MLA_GATHER:  # the engine's GatherMlaCache
        out += _elems(k.in_dtype, "", "dst") + _elems(k.in_dtype, "const ", "src_cache")
        out += _p("const int *", "block_table", "cu_seq_lens", "token_to_seq")
        if k.seq_starts is SeqStarts.GIVEN:
            out += _p("const int *", "seq_starts")
        out += _p("int", "num_tokens", "num_reqs", "num_blocks", "block_size", "max_blocks")
    elif k.op is Op.MLA_DECODE:  # split stage: partials [B][Hq][kv_splits] (acc x V width)
        out += _elems(k.in_dtype, "const ", "query", "kv_cache")
        out += _p("const int *", "block_table", "seq_lens")
        out += _p("float *", "m_out", "l_out", "acc_out")
        out += _p("int", "n_head", "kv_splits", "num_blocks", "block_size", "max_blocks")
        out += _p("float", "scale")
    elif k.op is Op.MLA_COMBINE:  # merge stage, the splits in ascending order
        out += _p("const float *", "m_in", "l_in", "acc_in") + _p("const int *", "seq_lens")
        out += _elems(k.out_dtype, "", "out") + _p("float *", *(["lse"] if k.lse is Lse.WRITE
                                                                else []))
        out += _p("int", "n_head", "kv_splits")
    elif k.op is Op.MLA_PREFILL:  # the engine's MlaPrefillAttention; lse [n_head][total_q]
        out += _elems(k.in_dtype, "const ", "query", "key", "value")
        out += _p("const int *", "cu_seqlens_q", "cu_seqlens_k")
        out += _elems(k.out_dtype, "", "out") + _p("float *", *(["lse"] if k.lse is Lse.WRITE
                                                                else []))
        out += _p("int", "n_head", "num_reqs", "total_q") + _p("float", "scale")
    elif k.op is Op.DFLASH_ATTENTION:  # the engine's argument order and names
        paged = k.key_source is KeySource.PAGED
        out += _elems(k.out_dtype, "", "out") + _elems(k.in_dtype, "const ", "query")
        out += _elems(k.in_dtype, "const ", *(("block_key", "block_value", "ctx_key",
                                               "ctx_value") if paged else ("key", "value")))
        out += _p("const int *", "cu_seqlens", *(("seq_lens", "block_table") if paged else ()))
        out += _p("int", "n_rows", "n_head", "n_head_kv", "head_dim", "num_reqs")
        if paged:
            out += _p("int", "block_size", "max_blocks", "num_pages")
        out += _p("int", "block_causal", "sliding_window") + _p("float", "scale")
    elif k.op is Op.DENSE_ATTENTION:  # the engine's Attention(out, query, key, value)
        out += _elems(k.out_dtype, "", "out") + _elems(k.in_dtype, "const ", "query", "key",
                                                       "value")
        out += _p("int", "n_rows", "n_head", "n_head_kv", "head_dim", "block_causal")
        out += _p("float", "scale")
    return tuple(out)
