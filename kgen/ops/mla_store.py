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

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = MlaStore()
