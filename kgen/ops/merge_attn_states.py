"""The op ``merge_attn_states``: the engine's MergeAttnStates: two partial results over
disjoint keys, merged by their LSEs.
"""

from __future__ import annotations

from kgen.ir.axes import Lse, Op
from kgen.ops.base import OpDef


class MergeAttnStates(OpDef):
    op = Op.MERGE_ATTN_STATES

    # --- spec: axes and checks
    in_dtype = True
    out_dtype = True

    # --- signature and geometry

    # --- render
    def render_flags(self, k) -> frozenset[str]:
        return frozenset({"merge"})

    def merge_io(self, k) -> tuple[tuple, ...]:
        return ((k.in_dtype.fmt, k.out_dtype.fmt),)

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block of warps, a warp per row
        from kgen.ir.geometry import merge_threads

        return merge_threads(), 0

    # --- binding and launch

    # --- C++ view
    def cpp_roles(self) -> dict:
        from kgen.runtime import merge

        return {"merge": merge.role(Lse.NONE), "merge_lse": merge.role(Lse.WRITE)}

    # --- contracts, reference and test cases


OP = MergeAttnStates()
