"""The op ``mla_combine``: MLA decode, merge stage: the splits in ascending order."""

from __future__ import annotations

from kgen.ir.axes import Lse, Op
from kgen.ops.base import OpDef


class MlaCombine(OpDef):
    op = Op.MLA_COMBINE

    # --- spec: axes and checks
    mla = True
    out_dtype = True

    # --- signature and geometry

    # --- render
    def writes_mla_lse(self, k) -> bool:
        return k.lse is Lse.WRITE  # [B][Hq]

    def render_flags(self, k) -> frozenset[str]:
        return frozenset({"mla"})  # the split bounds

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, all its shared memory static
        from kgen.ir.geometry import mla_threads

        return mla_threads(k), 0

    # --- binding and launch

    # --- C++ view
    def cpp_roles(self) -> dict:
        from kgen.runtime import mla

        return {f"mla_combine_{lse.value}": mla.role(self.op, lse=lse.value) for lse in Lse}

    # --- contracts, reference and test cases


OP = MlaCombine()
