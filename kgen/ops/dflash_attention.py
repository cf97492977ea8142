"""The op ``dflash_attention``: the engine's DFlash block attention: each query attends only
its request's block (and, paged, its context).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import KeySource, Op
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class DflashAttention(OpDef):
    op = Op.DFLASH_ATTENTION

    # --- spec: axes and checks
    in_dtype = True
    out_dtype = True

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:  # the engine's argument order and names
        paged = k.key_source is KeySource.PAGED
        out = elems(k.out_dtype, "", "out") + elems(k.in_dtype, "const ", "query")
        out += elems(k.in_dtype, "const ", *(("block_key", "block_value", "ctx_key",
                                              "ctx_value") if paged else ("key", "value")))
        out += fixed("const int *", "cu_seqlens", *(("seq_lens", "block_table") if paged else ()))
        out += fixed("int", "n_rows", "n_head", "n_head_kv", "head_dim", "num_reqs")
        if paged:
            out += fixed("int", "block_size", "max_blocks", "num_pages")
        out += fixed("int", "block_causal", "sliding_window") + fixed("float", "scale")
        return out

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = DflashAttention()
