"""The op ``qz_split``: split the joint q+gate projection."""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class QzSplit(OpDef):
    op = Op.QZ_SPLIT

    # --- spec: axes and checks

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = QzSplit()
