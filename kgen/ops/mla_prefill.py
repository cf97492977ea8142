"""The op ``mla_prefill``: MLA prefill: the engine's MlaPrefillAttention, varlen attention, QK
192, V 128.
"""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class MlaPrefill(OpDef):
    op = Op.MLA_PREFILL

    # --- spec: axes and checks
    mla = True
    in_dtype = True
    out_dtype = True
    own_keys = frozenset({"mask", "lse"})

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = MlaPrefill()
