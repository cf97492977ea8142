"""The op ``gather_mla_cache``: MLA: the engine's GatherMlaCache, requests' cache rows into a
contiguous workspace.
"""

from __future__ import annotations

from kgen.ir.axes import Op, SeqStarts
from kgen.ops.base import OpDef


class MlaGather(OpDef):
    op = Op.MLA_GATHER

    # --- spec: axes and checks
    mla = True
    in_dtype = True

    # --- signature and geometry

    # --- render
    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, all its shared memory static
        from kgen.ir.geometry import mla_threads

        return mla_threads(k), 0

    # --- binding and launch

    # --- C++ view
    def cpp_roles(self) -> dict:
        from kgen.runtime import mla

        return {f"mla_gather_{s.value}": mla.role(self.op, seq_starts=s.value)
                for s in SeqStarts}

    # --- contracts, reference and test cases


OP = MlaGather()
