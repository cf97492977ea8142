"""The op ``decode_combine``: merge split-decode partials into the output."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Combine, Op, Position, Sinks
from kgen.ir.signature import fixed, position_params
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class DecodeCombine(OpDef):
    op = Op.DECODE_COMBINE

    # --- spec: axes and checks
    planned = True

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        out = fixed("const float *", "m_in", "l_in", "acc_in") + fixed("float *", "out")
        if k.sinks is Sinks.LEARNED:
            out += fixed("const float *", "sinks")
        out += fixed("int", "head_dim")
        out += position_params(k, fixed("int", "n_splits"))
        if k.position is not Position.HOST:
            out += fixed("int", "kps", "splits_cap")
        return out

    def combine_staged(self, k: Kernel) -> bool:
        return k.combine is Combine.STAGED

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = DecodeCombine()
