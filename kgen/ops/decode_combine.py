"""The op ``decode_combine``: merge split-decode partials into the output."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Op, Position, Sinks
from kgen.ir.signature import fixed, position_params
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class DecodeCombine(OpDef):
    op = Op.DECODE_COMBINE

    # --- spec: axes and checks
    planned = True
    own_keys = frozenset({"position", "tile_keys", "sinks", "combine"})

    def check_mode_position(self, k: Kernel, ctx: Ctx) -> None:
        """The combine has no per-slot or paged form."""
        if k.position in (Position.SLOTS, Position.PAGED):
            raise ctx.error(k.where("position"), f"combine has no {k.position.value} form: those "
                            "partials are merged by the host-position combine over every "
                            "request's heads (n_splits = the launch width)")

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

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = DecodeCombine()
