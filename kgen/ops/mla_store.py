"""The op ``concat_and_cache_mla``: MLA: the engine's ConcatAndCacheMla, latent kv_c and k_pe
rows into the paged cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Op
from kgen.ir.geometry import MLA_STORE_THREADS
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class MlaStore(OpDef):
    op = Op.MLA_STORE

    # --- spec: axes and checks
    mla = True
    in_dtype = True

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        # the engine's ConcatAndCacheMla; row strides in elements
        out = elems(k.in_dtype, "const ", "kv_c", "k_pe") + elems(k.in_dtype, "", "kv_cache")
        out += fixed("const long long *", "slot_mapping")
        out += fixed("int", "n_slots", "kv_c_stride", "k_pe_stride", "num_blocks", "block_size")
        return out

    def mla_threads(self, k: Kernel) -> int:
        return MLA_STORE_THREADS

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = MlaStore()
