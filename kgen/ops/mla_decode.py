"""The op ``mla_decode``: MLA decode, split stage: (m, l, acc) per key split."""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class MlaDecode(OpDef):
    op = Op.MLA_DECODE

    # --- spec: axes and checks
    mla = True
    in_dtype = True

    # --- signature and geometry

    # --- render
    def render_flags(self, k) -> frozenset[str]:
        return frozenset({"mla"})  # the split bounds

    def template_parts(self, k) -> tuple[str, ...]:
        return ("kernels/mla_parts.j2",)

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, all its shared memory static
        from kgen.ir.geometry import mla_threads

        return mla_threads(k), 0

    # --- binding and launch

    # --- C++ view
    def cpp_roles(self) -> dict:
        from kgen.runtime import mla

        return {"mla_decode": mla.role(self.op)}

    # --- contracts, reference and test cases


OP = MlaDecode()
