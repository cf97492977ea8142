"""The op ``gather_mla_cache``: MLA: the engine's GatherMlaCache, requests' cache rows into a
contiguous workspace.
"""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class MlaGather(OpDef):
    op = Op.MLA_GATHER

    # --- spec: axes and checks
    mla = True
    in_dtype = True
    own_keys = frozenset({"seq_starts"})

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = MlaGather()
