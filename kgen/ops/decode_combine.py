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
    lists_occupancy = True

    def render_flags(self, k) -> frozenset[str]:
        return frozenset({"combine", *(("combine_sinks",) if k.learned_sinks else ())})

    def occupancy_block(self, k, hd: int, groups: int | None) -> tuple[int, int]:
        from kgen.ir.geometry import combine_threads

        return combine_threads(k, hd), 0

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = DecodeCombine()
