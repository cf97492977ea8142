"""Attention over pages and metadata the caller owns: an inference engine's model (vLLM's).

An engine owns, per layer, its KV pages ``key_cache`` / ``value_cache``
``[num_blocks, block_size, n_head_kv, row]`` in a kgen format (``row`` the format's row
width: head_dim for f32, f16 and bf16), and per step the index tensors of a batch:
``query_start_loc`` [B + 1], ``seq_lens`` [B] (each sequence's keys, this step's tokens
counted), ``block_table`` [B, max_blocks] (int32) and ``slot_mapping`` [T] (int32 or
int64, vLLM's; -1 skips a token). It builds one :class:`PagedMetadata` a step, which
checks the index tensors once (read back, unless ``validate=False`` or the stream is
capturing a graph) and narrows int64 slots once; every layer then calls

    reshape_and_cache(key, value, key_cache, value_cache, meta)  # this step's K/V rows
    out = paged_attention(query, key_cache, value_cache, meta)    # decode or varlen prefill

with nothing rebuilt in Python per layer: the kernels are chosen once per (format,
head_dim, q heads per kv head, options) and the plan once per step. A step whose
``max_query_len`` is 1 decodes (split decode and combine); any other step is a varlen
prefill (each sequence's query rows aligned to its end, causal). The launches are
:class:`kgen.runtime.paged.PagedKVCache`'s (which allocates its pages and builds these
tensors itself): on the same data, with the true ``max_query_len``, the two give the
same bits. Arrays come from any GPU library, on the caller's stream
(kgen.runtime.convention).
"""

from __future__ import annotations

import numpy as np

from kgen.formats import FORMATS
from kgen.runtime import device
from kgen.runtime.calls import Calls
from kgen.runtime.contracts import ContractError
from kgen.runtime.convention import as_device_array, element_aligned, public, read_back
from kgen.runtime.kv import Scratch, cache_formats
from kgen.runtime.options import Options, count, groups, scales
from kgen.runtime.paged import decode_calls, decode_kernels, prefill_calls
from kgen.runtime.pending import empty
from kgen.runtime.roles import CacheKernels

WHO = "kgen.runtime.engine"
_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)
# vLLM's kv_cache_dtype spellings beside kgen's own format names
_ALIASES = {"fp8": "fp8_e4m3", "float32": "f32", "float16": "f16", "half": "f16",
            "bfloat16": "bf16"}
_BY_DTYPE = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
             np.dtype(np.uint16): "bf16"}  # "auto": the pages' own element type
_KERNELS: dict[tuple[str, int], CacheKernels] = {}
_SCRATCH: dict[int, tuple[Scratch, Scratch]] = {}  # per device: decode, prefill partials


def kv_format(kv_cache_dtype, key_cache, who: str = WHO) -> str:
    """The kgen format of a cache: ``kv_cache_dtype`` by kgen's name or vLLM's
    (``"fp8"``), or ``"auto"`` for the pages' own float type (f32, f16, bf16)."""
    if kv_cache_dtype == "auto":
        name = _BY_DTYPE.get(np.dtype(key_cache.dtype))
        if name is None:
            raise ContractError(who, "kv_cache_dtype", f"pages of {key_cache.dtype} hold a "
                                f"quantized format: name it (one of {sorted(FORMATS)})")
        return name
    name = _ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if not isinstance(name, str) or name not in FORMATS:
        raise ContractError(who, "kv_cache_dtype", f"kv_cache_dtype must be 'auto' or one of "
                            f"{sorted(FORMATS)} (or 'fp8'), not {kv_cache_dtype!r}")
    return name


def _kernels(kv: str, head_dim: int) -> CacheKernels:
    key = (kv, head_dim)
    got = _KERNELS.get(key)
    if got is None:
        got = _KERNELS[key] = CacheKernels(kv, head_dim, None, layout_role="append_paged")
    return got


def _scratch() -> tuple[Scratch, Scratch]:
    dev = device.cupy().cuda.runtime.getDevice()
    got = _SCRATCH.get(dev)
    if got is None:
        got = _SCRATCH[dev] = (Scratch(), Scratch())
    return got


def _index(who: str, name: str, a, dtypes, ndim: int):
    """An index tensor of one of ``dtypes`` and ``ndim`` dimensions, C-contiguous and on
    its element's boundary (int64 slots are narrowed on the GPU before any kernel's
    contract sees them)."""
    if getattr(a, "ndim", None) != ndim or np.dtype(a.dtype) not in dtypes or \
            not a.flags.c_contiguous:
        want = " or ".join(d.name for d in dtypes)
        raise ContractError(who, "shape", f"{name} must be a C-contiguous {want} array of "
                            f"{ndim} dimension{'s' if ndim > 1 else ''}, not "
                            f"{getattr(a, 'dtype', type(a).__name__)} "
                            f"{tuple(getattr(a, 'shape', ()))}")
    element_aligned(name, a, who)


class PagedMetadata:
    """One step's index tensors, checked once and shared by every layer's calls.

    query_start_loc int32 [B + 1] (request r's query rows [qsl[r], qsl[r + 1])),
    seq_lens int32 [B] (its keys, this step's tokens counted), block_table int32
    [B, max_blocks], slot_mapping int32 or int64 [T] (the slot of each new token, -1:
    none; int64 narrowed once here), max_query_len and max_seq_len the host's bounds
    (max_query_len 1: a decode step). With ``validate`` (None, the default: unless the
    stream is capturing a graph) the tensors are read back once and checked: rising
    query_start_loc from 0, every request's rows within max_query_len and its keys,
    lengths within max_seq_len and the table's blocks, the blocks they use mapped."""

    @public(WHO, arrays=("query_start_loc", "seq_lens", "block_table", "slot_mapping"))
    def __init__(self, query_start_loc, seq_lens, block_table, slot_mapping,
                 max_query_len: int, max_seq_len: int, *, validate: bool | None = None,
                 stream=None):
        _index(WHO, "query_start_loc", query_start_loc, (_I32,), 1)
        _index(WHO, "seq_lens", seq_lens, (_I32,), 1)
        _index(WHO, "block_table", block_table, (_I32,), 2)
        _index(WHO, "slot_mapping", slot_mapping, (_I32, _I64), 1)
        B = int(seq_lens.shape[0])
        if int(query_start_loc.shape[0]) != B + 1 or int(block_table.shape[0]) < B or B < 1:
            raise ContractError(WHO, "shape", f"query_start_loc must have B + 1 entries and "
                                f"block_table at least B rows for B = {B} >= 1 sequences, "
                                f"not {tuple(query_start_loc.shape)}, "
                                f"{tuple(block_table.shape)}")
        self.max_query_len = count("max_query_len", max_query_len, 1, WHO)
        self.max_seq_len = count("max_seq_len", max_seq_len, 1, WHO)
        self.batch = B
        self.decode = self.max_query_len == 1
        self.validated = read_back(validate, stream, WHO)
        if self.validated:
            self._check(query_start_loc.get(), seq_lens.get(), block_table.get(),
                        int(slot_mapping.shape[0]))
        if slot_mapping.dtype == _I64:  # the kernels take int32 slots: narrowed once
            slot_mapping = slot_mapping.astype(np.int32)
        self.query_start_loc, self.seq_lens = query_start_loc, seq_lens
        self.block_table, self.slot_mapping = block_table[:B], slot_mapping
        self._pages_checked: set[tuple[int, int]] = set()
        self.plans: dict[tuple, tuple] = {}  # decode kernels and plan, per layer shape

    def _check(self, qsl, lens, table, slots: int) -> None:
        self._host = (qsl, lens, table[: self.batch])
        rows = np.diff(qsl.astype(np.int64))
        bad = []
        if qsl[0] != 0 or (rows < 0).any():
            bad.append("query_start_loc must rise from 0")
        elif qsl[-1] > slots:
            bad.append(f"query_start_loc ends at {qsl[-1]}, past the {slots} slots")
        elif (rows > self.max_query_len).any():
            bad.append(f"a request has {rows.max()} query rows, above max_query_len = "
                       f"{self.max_query_len}")
        elif (lens < rows).any() or (lens > self.max_seq_len).any():
            bad.append(f"seq_lens must lie in [the request's query rows, max_seq_len = "
                       f"{self.max_seq_len}]")
        elif self.decode and (rows != 1).any():
            bad.append("a decode step (max_query_len = 1) has one query row a sequence")
        if bad:
            raise ContractError(WHO, "metadata", bad[0])

    def pages(self, key_cache, who: str) -> None:
        """The block table maps the blocks the lengths use into ``key_cache``'s pages
        (checked once per page count and block size, where the tensors were read)."""
        key = (int(key_cache.shape[0]), int(key_cache.shape[1]))
        if not self.validated or key in self._pages_checked:
            return
        _, lens, table = self._host
        num_blocks, bs = key
        need = -(-lens.astype(np.int64) // bs)
        if (need > table.shape[1]).any():
            raise ContractError(who, "metadata", f"seq_lens need up to {need.max()} blocks of "
                                f"{bs}; the block table has {table.shape[1]} a sequence")
        for r, n in enumerate(need):
            used = table[r, :n]
            if ((used < 0) | (used >= num_blocks)).any():
                raise ContractError(who, "metadata", f"sequence {r} maps a block outside "
                                    f"[0, {num_blocks})")
        self._pages_checked.add(key)


_SCALES: dict[tuple, dict] = {}


def _scales(kv: str, k_scale, v_scale, who: str) -> dict:
    """The format's per-tensor scale arguments, as PagedKVCache passes them (kept per
    format and value: a layer asks each step)."""
    try:
        key = (kv, type(k_scale), k_scale, type(v_scale), v_scale)
        hit = _SCALES.get(key)
    except TypeError:  # unhashable: the checks below refuse it
        key = hit = None
    if hit is None:
        hit = _checked_scales(kv, k_scale, v_scale, who)
        if key is not None and len(_SCALES) < 4096:
            _SCALES[key] = hit
    return hit


def _checked_scales(kv: str, k_scale, v_scale, who: str) -> dict:
    pair = cache_formats(who, kv, None)
    ks, vs = scales(pair, k_scale, v_scale, who)
    given = {"k_scale": ks, "v_scale": vs}
    return {name: given[name] for name in pair.scale_scalars()}


def _meta(meta) -> PagedMetadata:
    if not isinstance(meta, PagedMetadata):
        raise ContractError(WHO, "metadata", "metadata must be a kgen PagedMetadata, not "
                            f"{type(meta).__name__}")
    return meta


@public("reshape_and_cache", widen_args=("key", "value"), arrays=("key_cache", "value_cache"))
def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                      kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0,
                      *, stream=None) -> None:
    """vLLM's reshape_and_cache_flash: token t's key[t] and value[t] ([T, n_head_kv,
    head_dim], float32, float16 or bfloat16) into slot slot_mapping[t] of the pages
    (block slot // block_size, row slot % block_size), quantized to the cache's format;
    a negative slot skips the token. ``slot_mapping``: a PagedMetadata (its narrowed
    slots) or an int32 / int64 tensor."""
    slots = slot_mapping.slot_mapping if isinstance(slot_mapping, PagedMetadata) else \
        as_device_array("slot_mapping", slot_mapping, "reshape_and_cache")
    _index("reshape_and_cache", "slot_mapping", slots, (_I32, _I64), 1)
    if slots.dtype == _I64:
        slots = slots.astype(np.int32)
    kv = kv_format(kv_cache_dtype, key_cache, "reshape_and_cache")
    if getattr(key, "ndim", 0) != 3:
        raise ContractError("reshape_and_cache", "shape", "key must be [T, n_head_kv, "
                            f"head_dim], not {tuple(getattr(key, 'shape', ()))}")
    kernels = _kernels(kv, int(key.shape[2]))
    kw = _scales(kv, k_scale, v_scale, "reshape_and_cache")
    _, fn = kernels.get("append_paged")
    calls = Calls()
    calls.add(fn, key, value, key_cache, value_cache, slots, **kw, validate_pos=False)
    calls.run(stream)


@public("paged_attention", widen_args=("query",),
        arrays=("key_cache", "value_cache", "out", "sinks"))
def paged_attention(query, key_cache, value_cache, metadata: PagedMetadata, out=None, *,
                    kv_cache_dtype: str = "auto", scale: float | None = None,
                    window_size: tuple[int, int] | None = None, softcap: float = 0.0,
                    sinks=None, k_scale: float = 1.0, v_scale: float = 1.0, stream=None):
    """Attention of query [T, n_head, head_dim] (float32, float16 or bfloat16) over the
    caller's pages through ``metadata``: a decode step (max_query_len 1: one row a
    sequence, T = B) or a varlen prefill (causal, each request's rows aligned to its
    end). ``out``: float32 [T, n_head, head_dim], or None for a new one (returned in
    query's dtype). Options as the caches take them (window_size, softcap, sinks: a
    float32 logit per q head); k_scale / v_scale: per-tensor scales of fp8 pages."""
    meta = _meta(metadata)
    who = "paged_attention"
    if getattr(query, "ndim", 0) != 3:
        raise ContractError(who, "shape", f"query must be [T, n_head, head_dim], not "
                            f"{tuple(getattr(query, 'shape', ()))}")
    if getattr(key_cache, "ndim", 0) != 4:
        raise ContractError(who, "shape", "key_cache must be pages [num_blocks, block_size, "
                            f"n_head_kv, row], not {tuple(getattr(key_cache, 'shape', ()))}")
    T, n_head, head_dim = (int(x) for x in query.shape)
    kv = kv_format(kv_cache_dtype, key_cache, who)
    kernels = _kernels(kv, head_dim)
    G = groups(n_head, int(key_cache.shape[2]), who)
    sc = _scales(kv, k_scale, v_scale, who)
    opts = Options.checked(n_head, 0, 0, scale, window_size, softcap, sinks, True)
    if out is not None and (np.dtype(out.dtype) != np.float32 or tuple(out.shape) != (
            T, n_head, head_dim) or not out.flags.c_contiguous):
        raise ContractError(who, "shape", f"out must be C-contiguous float32 "
                            f"{[T, n_head, head_dim]}, not {out.dtype} {tuple(out.shape)}")
    meta.pages(key_cache, who)
    dec, pre = _scratch()
    calls = Calls()
    decode = meta.decode and not kernels.by_prefill(
        "decode_paged", "prefill_paged", G, opts, None, None, who, "a prefill")
    if decode:
        if meta.batch != T:
            raise ContractError(who, "shape", f"a decode step has one query row a sequence: "
                                f"{meta.batch}, not {T}")
        key = (id(kernels), int(key_cache.shape[2]), G, tuple(opts.needs("decode_paged")),
               tuple(opts.needs("combine")))
        plan = meta.plans.get(key)
        if plan is None:  # the plan once a step: every layer of one shape shares it
            plan = meta.plans[key] = decode_kernels(kernels, int(key_cache.shape[2]), G, opts,
                                                    None, None, T, who)
        flat = decode_calls(calls, dec, query, key_cache, value_cache,
                            {"block_table": meta.block_table, "seq_lens": meta.seq_lens},
                            meta.max_seq_len, plan, opts, sc, sinks, out)
        calls.run(stream)
        return out if out is not None else flat.made().reshape(T, n_head, head_dim)
    res = empty((T, n_head, head_dim)) if out is None else out
    index = {"block_table": meta.block_table, "seq_lens": meta.seq_lens,
             "query_start_loc": meta.query_start_loc}
    prefill_calls(calls, kernels, pre, query, key_cache, value_cache, index,
                  meta.max_query_len, meta.batch, G, opts, sc, res)
    calls.run(stream)
    return out if out is not None else res.made()


__all__ = ["PagedMetadata", "kv_format", "paged_attention", "reshape_and_cache"]
