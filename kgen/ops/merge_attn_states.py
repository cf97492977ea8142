"""The op ``merge_attn_states``: the engine's MergeAttnStates: two partial results over
disjoint keys, merged by their LSEs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Lse, Op
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class MergeAttnStates(OpDef):
    op = Op.MERGE_ATTN_STATES

    # --- spec: axes and checks
    in_dtype = True
    out_dtype = True
    own_keys = frozenset({"lse"})

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:  # the engine's argument order and names
        out = elems(k.out_dtype, "", "output")
        out += fixed("float *", *(["output_lse"] if k.lse is Lse.WRITE else []))
        out += elems(k.in_dtype, "const ", "prefix_output")
        out += fixed("const float *", "prefix_lse")
        out += elems(k.in_dtype, "const ", "suffix_output")
        out += fixed("const float *", "suffix_lse")
        out += fixed("int", "n_tokens", "n_head", "head_dim", "prefill_tokens_with_context")
        return out

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = MergeAttnStates()
