"""The op ``qz_split``: split the joint q+gate projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Op
from kgen.ir.signature import fixed
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class QzSplit(OpDef):
    op = Op.QZ_SPLIT

    # --- spec: axes and checks

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        return (fixed("const float *", "qg") + fixed("float *", "q", "z")
                + fixed("int", "head_dim", "total"))

    def validates_pos(self, k: Kernel) -> bool:
        return False  # its kernels read no positions, whatever the position axis says

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = QzSplit()
