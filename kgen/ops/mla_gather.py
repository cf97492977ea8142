"""The op ``gather_mla_cache``: MLA: the engine's GatherMlaCache, requests' cache rows into a
contiguous workspace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Op, SeqStarts
from kgen.ir.geometry import mla_gather_threads
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class MlaGather(OpDef):
    op = Op.MLA_GATHER

    # --- spec: axes and checks
    mla = True
    in_dtype = True
    own_keys = frozenset({"seq_starts"})

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:  # the engine's GatherMlaCache
        out = elems(k.in_dtype, "", "dst") + elems(k.in_dtype, "const ", "src_cache")
        out += fixed("const int *", "block_table", "cu_seq_lens", "token_to_seq")
        if k.seq_starts is SeqStarts.GIVEN:
            out += fixed("const int *", "seq_starts")
        out += fixed("int", "num_tokens", "num_reqs", "num_blocks", "block_size", "max_blocks")
        return out

    def mla_threads(self, k: Kernel) -> int:
        return mla_gather_threads()

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = MlaGather()
