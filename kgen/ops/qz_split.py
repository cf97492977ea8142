"""The op ``qz_split``: split the joint q+gate projection."""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class QzSplit(OpDef):
    op = Op.QZ_SPLIT

    # --- spec: axes and checks

    # --- signature and geometry

    # --- render
    takes_head_dim = False

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        from kgen.runtime.bind import QZ_BLOCK

        return QZ_BLOCK, 0  # a fixed block, no head_dim

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = QzSplit()
