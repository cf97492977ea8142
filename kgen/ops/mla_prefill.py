"""The op ``mla_prefill``: MLA prefill: the engine's MlaPrefillAttention, varlen attention, QK
192, V 128.
"""

from __future__ import annotations

from kgen.ir.axes import Lse, Mask, Op
from kgen.ops.base import OpDef


class MlaPrefill(OpDef):
    op = Op.MLA_PREFILL

    # --- spec: axes and checks
    mla = True
    in_dtype = True
    out_dtype = True

    # --- signature and geometry

    # --- render
    def writes_mla_lse(self, k) -> bool:
        return k.lse is Lse.WRITE  # [H][total_q]

    def mla_causal(self, k) -> bool:
        return k.mask is Mask.CAUSAL  # query i sees keys j <= i + Lk - Lq

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

        return {f"mla_prefill_{m.value}_{lse.value}": mla.role(self.op, mask=m.value,
                                                               lse=lse.value)
                for lse in Lse for m in Mask}

    # --- contracts, reference and test cases


OP = MlaPrefill()
