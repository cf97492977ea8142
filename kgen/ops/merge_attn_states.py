"""The op ``merge_attn_states``: the engine's MergeAttnStates: two partial results over
disjoint keys, merged by their LSEs.
"""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class MergeAttnStates(OpDef):
    op = Op.MERGE_ATTN_STATES

    # --- spec: axes and checks
    in_dtype = True
    out_dtype = True
    own_keys = frozenset({"lse"})

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = MergeAttnStates()
