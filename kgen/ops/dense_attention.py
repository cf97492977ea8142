"""The op ``dense_attention``: the engine's AttentionDenseFast / AttentionDenseFlash: one
sequence, a warp per (query, q head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Op
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class DenseAttention(OpDef):
    op = Op.DENSE_ATTENTION

    # --- spec: axes and checks
    in_dtype = True
    out_dtype = True

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        # the engine's Attention(out, query, key, value)
        out = elems(k.out_dtype, "", "out")
        out += elems(k.in_dtype, "const ", "query", "key", "value")
        out += fixed("int", "n_rows", "n_head", "n_head_kv", "head_dim", "block_causal")
        out += fixed("float", "scale")
        return out

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = DenseAttention()
