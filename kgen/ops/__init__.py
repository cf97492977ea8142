"""The engine ops, registered by their spec spelling.

A new op is a module here (its ``OP`` object, a subclass of ``OpDef``), a line
below, its template under ``templates/`` and a spec that builds its kernels.
Everything else (the signature, launch geometry, render, binding, C++ view,
contracts, reference and tests) asks the op object; nothing outside this package
switches on an op.
"""

from __future__ import annotations

from kgen.ir.axes import Op, declare_key_ops
from kgen.ir.kernel import Kernel
from kgen.ir.pyapi import DEFAULTS, DERIVED, PyArg
from kgen.ir.signature import Param
from kgen.ops import (
    decode_combine,
    dense_attention,
    dflash_attention,
    flash,
    kv_append,
    mask_empty_context_lse,
    merge_attn_states,
    mla_combine,
    mla_decode,
    mla_gather,
    mla_prefill,
    mla_store,
    qz_split,
)
from kgen.ops.base import OpDef, PublicCall

# Registration: the one place that lists the ops.
OPS: dict[Op, OpDef] = {m.OP.op: m.OP for m in (
    qz_split, kv_append, flash, decode_combine, merge_attn_states, mla_store, mla_gather,
    mla_decode, mla_combine, mla_prefill, dflash_attention, dense_attention,
    mask_empty_context_lse)}
# The spec keys each op takes, for the vocabulary's Key.ops (kgen.ir.axes cannot import this).
declare_key_ops({op: d.spec_keys for op, d in OPS.items()})


def get(op: Op | str) -> OpDef:
    """The op object of a spelling (an ``Op`` or its value); unknown is a KeyError."""
    return OPS[Op(op)]


_PARAMS: dict[int, tuple[Kernel, tuple[Param, ...]]] = {}


def params(k: Kernel) -> tuple[Param, ...]:
    """The kernel's parameter list, as its op builds it (memoised per kernel object:
    launches ask often)."""
    hit = _PARAMS.get(id(k))
    if hit is not None and hit[0] is k:
        return hit[1]
    out = tuple(OPS[k.op].params(k))
    _PARAMS[id(k)] = (k, out)
    return out


def py_args(k: Kernel) -> tuple[list[PyArg], list[PyArg]]:
    """(positional arrays, keyword-only scalars) of the launcher for ``k``: its
    parameters less those the launcher derives from shapes (kgen.ir.pyapi.DERIVED),
    then its op's host bounds and, where it reads indices from the device, the
    read-back switch."""
    arrays, scalars = [], []
    for p in params(k):
        if p.name in DERIVED:
            continue
        if p.is_pointer:
            arrays.append(PyArg(p.name, "cupy.ndarray", dtype=p.dtype))
        else:
            ann = "float | None" if p.ctype == "float" else "int"
            scalars.append(PyArg(p.name, ann, DEFAULTS.get(p.name)))
    op = OPS[k.op]
    scalars += op.host_bounds(k)
    # Positions, tables and lengths on the device (the MLA ops' index tensors too).
    if op.validates_pos(k):
        scalars.append(PyArg("validate_pos", "bool", "True"))
    return arrays, scalars


__all__ = ["OPS", "OpDef", "PublicCall", "get", "params", "py_args"]
