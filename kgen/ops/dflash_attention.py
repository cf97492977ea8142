"""The op ``dflash_attention``: the engine's DFlash block attention: each query attends only
its request's block (and, paged, its context).
"""

from __future__ import annotations

from kgen.ir.axes import KeySource, Op
from kgen.ops.base import OpDef


class DflashAttention(OpDef):
    op = Op.DFLASH_ATTENTION

    # --- spec: axes and checks
    in_dtype = True
    out_dtype = True

    # --- signature and geometry

    # --- render
    def render_flags(self, k) -> frozenset[str]:
        return frozenset({"dflash"})

    def sized_head_dim(self, k) -> int | None:
        return k.max_head_dim  # a warp's q and output rows, in registers

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, whatever head_dim
        from kgen.ir.geometry import dflash_threads

        return dflash_threads(), 0

    # --- binding and launch

    # --- C++ view
    def cpp_view(self, k, hd, groups, rows) -> dict:
        # the paged context then the block (key_source = paged)
        return super().cpp_view(k, hd, groups, rows) | {
            "paged_keys": k.key_source is KeySource.PAGED}

    def cpp_roles(self) -> dict:
        from kgen.runtime import dflash

        return {f"dflash_{src.value}": dflash.role(src) for src in KeySource}

    # --- contracts, reference and test cases


OP = DflashAttention()
