"""The op ``dense_attention``: the engine's AttentionDenseFast / AttentionDenseFlash: one
sequence, a warp per (query, q head).
"""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class DenseAttention(OpDef):
    op = Op.DENSE_ATTENTION

    # --- spec: axes and checks
    in_dtype = True
    out_dtype = True

    # --- signature and geometry

    # --- render
    def render_flags(self, k) -> frozenset[str]:
        return frozenset({"dflash"})  # the DFlash row helpers

    def sized_head_dim(self, k) -> int | None:
        return k.max_head_dim  # a warp's q and output rows, in registers

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, whatever head_dim; its tiles are static shared memory
        from kgen.ir.geometry import dense_threads

        return dense_threads(), 0

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = DenseAttention()
