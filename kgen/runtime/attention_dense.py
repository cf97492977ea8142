"""The engine's dense Attention over one sequence as calls: ``attention_dense_fast``
(AttentionDenseFast) and ``attention_dense_flash`` (AttentionDenseFlash).

query [T, Hq, D], key / value [T, Hkv, D] (GQA: q head h reads kv head h / (Hq / Hkv)),
out [T, Hq, D] (../shared/docs/engine-ops.md, "Dense attention dtypes"):
out = softmax(scale * q . k) . v over every key (causal = False) or keys j <= i
(causal = True), in f32. Inputs are float32 or bf16, the output float32 or bf16; a
bf16 array is its bit patterns, uint16 (kgen.formats.bf16: exact widening, the output
rounded to nearest even). The kernel is chosen by the arrays' element types
(in_dtype from query, out_dtype from out) and the call's kv_reads: the Flash kernel
gives the Fast kernel's bits. Every contract (kgen.runtime.bind: dtypes, contiguity,
shapes, GQA, head_dim, scale > 0 and finite) is checked before any launch.
"""

from __future__ import annotations

from kgen.ir.axes import IoDtype, KvReads, Op
from kgen.ir.params import PARAMS
from kgen.runtime import options
from kgen.runtime.convention import public
from kgen.runtime.options import flag
from kgen.runtime.select import Role, find

_CHOSEN: dict[tuple, tuple] = {}  # (reads, in, out, head_dim, variant) -> (kernel, launcher)
WHO = "kgen.runtime.attention_dense"


def role(reads: KvReads, in_dtype: IoDtype, out_dtype: IoDtype) -> Role:
    """What a call needs a kernel for: its K/V reads and element types."""
    return Role(Op.DENSE_ATTENTION, needs=(("kv_reads", reads.value),
                                           ("in_dtype", in_dtype.value),
                                           ("out_dtype", out_dtype.value)))


def io_dtype(name: str, a) -> IoDtype:
    """The element type an array holds (float32: f32; uint16: bf16 bit patterns)."""
    return options.io_dtype(name, a, WHO)


def launcher(reads: KvReads, in_dtype: IoDtype, out_dtype: IoDtype, head_dim: int,
             variant: str | None = None):
    """(kernel, generated launcher) serving the call at ``head_dim`` (``variant``: a
    kernel name, checked to serve it); chosen once per shape, then kept."""
    key = (reads, in_dtype, out_dtype, head_dim, variant)
    hit = _CHOSEN.get(key)
    if hit is None:
        hit = _CHOSEN[key] = find(role(reads, in_dtype, out_dtype), head_dim, 1, variant)
    return hit


def _call(reads: KvReads, out, query, key, value, scale, causal, stream, variant):
    causal = flag("causal", causal, WHO)
    fi, fo = io_dtype("query", query), io_dtype("out", out)
    shape = query.shape
    hd = int(shape[-1]) if len(shape) == 3 else 1  # bind refuses another rank
    fn = launcher(reads, fi, fo, hd, variant)[1]
    scalars = {"block_causal": causal}
    if scale is not None:
        scalars["scale"] = scale
    return fn(out, query, key, value, **scalars, stream=stream)


@public(WHO, arrays=("out", "query", "key", "value"))
def attention_dense_fast(out, query, key, value, scale: float | None = PARAMS["scale"].default,
                         causal: bool = bool(PARAMS["block_causal"].default), *,
                         stream=None, variant: str | None = None):
    """AttentionDenseFast: ``out`` [T, Hq, D] from query [T, Hq, D] over key / value
    [T, Hkv, D] (C-contiguous CuPy arrays, float32 or uint16 bf16 bits), a warp per
    (query, head) reading its keys from global memory. ``scale`` None: 1 / sqrt(D).
    Returns the bound kgen.runtime.Launch; a broken contract raises
    kgen.runtime.ContractError before any launch."""
    return _call(KvReads.GLOBAL, out, query, key, value, scale, causal, stream, variant)


@public(WHO, arrays=("out", "query", "key", "value"))
def attention_dense_flash(out, query, key, value, scale: float | None = PARAMS["scale"].default,
                          causal: bool = bool(PARAMS["block_causal"].default), *,
                          stream=None, variant: str | None = None):
    """AttentionDenseFlash: the contract of ``attention_dense_fast``, and its bits; a
    block of warps of one kv head shares each K/V tile from shared memory (long
    contexts)."""
    return _call(KvReads.SHARED_TILE, out, query, key, value, scale, causal, stream,
                 variant)
