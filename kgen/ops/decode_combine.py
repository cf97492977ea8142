"""The op ``decode_combine``: merge split-decode partials into the output."""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class DecodeCombine(OpDef):
    op = Op.DECODE_COMBINE

    # --- spec: axes and checks
    planned = True

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = DecodeCombine()
