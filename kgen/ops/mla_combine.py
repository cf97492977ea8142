"""The op ``mla_combine``: MLA decode, merge stage: the splits in ascending order."""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class MlaCombine(OpDef):
    op = Op.MLA_COMBINE

    # --- spec: axes and checks
    mla = True
    out_dtype = True
    own_keys = frozenset({"lse"})

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = MlaCombine()
