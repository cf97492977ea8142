"""The engine ops, registered by their spec spelling.

A new op is a module here (its ``OP`` object, a subclass of ``OpDef``), a line
below, its template under ``templates/`` and a spec that builds its kernels.
Everything else (the signature, launch geometry, render, binding, C++ view,
contracts, reference and tests) asks the op object; nothing outside this package
switches on an op.
"""

from __future__ import annotations

from kgen.ir.axes import Op, declare_key_ops
from kgen.ops import (
    decode_combine,
    dense_attention,
    dflash_attention,
    flash,
    kv_append,
    merge_attn_states,
    mla_combine,
    mla_decode,
    mla_gather,
    mla_prefill,
    mla_store,
    qz_split,
)
from kgen.ops.base import OpDef

# Registration: the one place that lists the ops.
OPS: dict[Op, OpDef] = {m.OP.op: m.OP for m in (
    qz_split, kv_append, flash, decode_combine, merge_attn_states, mla_store, mla_gather,
    mla_decode, mla_combine, mla_prefill, dflash_attention, dense_attention)}
# The spec keys each op takes, for the vocabulary's Key.ops (kgen.ir.axes cannot import this).
declare_key_ops({op: d.spec_keys for op, d in OPS.items()})


def get(op: Op | str) -> OpDef:
    """The op object of a spelling (an ``Op`` or its value); unknown is a KeyError."""
    return OPS[Op(op)]


__all__ = ["OPS", "OpDef", "get"]
