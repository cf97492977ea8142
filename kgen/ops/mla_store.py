"""The op ``concat_and_cache_mla``: MLA: the engine's ConcatAndCacheMla, latent kv_c and k_pe
rows into the paged cache.
"""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class MlaStore(OpDef):
    op = Op.MLA_STORE

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

        return {"mla_store": mla.role(self.op)}

    # --- contracts, reference and test cases


OP = MlaStore()
