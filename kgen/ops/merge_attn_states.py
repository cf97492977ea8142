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

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases
    mutated_array = "output"

    def contract_args(self, k, case, alloc) -> dict:
        from kgen.testing import merge

        return merge.host_args(k, case, alloc)

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.ir.axes import Lse
        from kgen.ir.params import INT_MAX
        from kgen.testing.arguments import (
            Makers,
            Mutation,
            ShapeOnly,
            always,
            other_elem,
            strided,
        )

        m = Makers(self)

        def merge_set(name, value_fn):
            """The merge's arguments (at a case with n_tokens != n_head, so a transposed
            LSE is told apart) with ``name`` replaced by value_fn(its array, case)."""
            return m.replace_from_case(name, value_fn, n=5, n_head=3)

        def transposed(a, c):
            return np.zeros(a.shape[::-1], a.dtype)

        def lse_written(k) -> bool:
            return k.lse is Lse.WRITE
        return {
            **super().contract_mutations(),
            "merge_prefix_lse_transposed": Mutation("lse layout", always, merge_set(
                "prefix_lse", transposed)),
            "merge_suffix_lse_transposed": Mutation("lse layout", always, merge_set(
                "suffix_lse", transposed)),
            "merge_output_lse_transposed": Mutation("lse layout", lse_written, merge_set(
                "output_lse", transposed)),
            "merge_lse_flat": Mutation("shape", always, merge_set(
                "prefix_lse", lambda a, c: np.zeros(a.size, a.dtype))),
            "merge_lse_tokens_mismatch": Mutation("lse layout", always, merge_set(
                "suffix_lse", lambda a, c: np.zeros((a.shape[0], a.shape[1] + 1), a.dtype))),
            "merge_suffix_elem": Mutation("dtype", always, merge_set(
                "suffix_output", lambda a, c: other_elem(a, c))),
            "merge_output_elem": Mutation("dtype", always, merge_set(
                "output", lambda a, c: other_elem(a, c))),
            "merge_lse_dtype": Mutation("dtype", always, merge_set(
                "suffix_lse", lambda a, c: a.astype(np.float64))),
            "merge_lse_non_contiguous": Mutation("contiguous", always, merge_set(
                "prefix_lse", lambda a, c: np.zeros((a.shape[0], 2 * a.shape[1]),
                                                    a.dtype)[:, ::2])),
            "merge_output_lse_dtype": Mutation("dtype", lse_written, merge_set(
                "output_lse", lambda a, c: a.astype(np.float16))),
            "merge_head_dim_mismatch": Mutation("shape", always, merge_set(
                "suffix_output", lambda a, c: np.zeros((*a.shape[:2], a.shape[2] + 1),
                                                       a.dtype))),
            "merge_tokens_mismatch": Mutation("shape", always, merge_set(
                "prefix_output", lambda a, c: np.zeros((a.shape[0] + 1, *a.shape[1:]),
                                                       a.dtype))),
            "merge_heads_mismatch": Mutation("shape", always, merge_set(
                "prefix_output", lambda a, c: np.zeros((a.shape[0], a.shape[1] + 1,
                                                        a.shape[2]), a.dtype))),
            "merge_suffix_non_contiguous": Mutation("contiguous", always, merge_set(
                "suffix_output", lambda a, c: strided(a, None, c))),
            "merge_suffix_not_an_array": Mutation("array", always, merge_set(
                "suffix_output", lambda a, c: a.tolist())),
            "merge_no_tokens": Mutation("shape", always, m.at(n=0)),
            "merge_int32_rows": Mutation("int32 index", always, lambda k, c: m.args(
                k, c.with_(n=2**27, n_head=16, head_dim=1), alloc=ShapeOnly)),
            "merge_prefill_tokens_over_int": Mutation("range", always, lambda k, c: {
                **m.args(k, c), "prefill_tokens_with_context": INT_MAX + 1}),
        }

    def mutated_integer(self, k) -> str | None:
        return "prefill_tokens_with_context"

    def case_candidates(self, k) -> list:
        from kgen.testing.shapes import MERGE

        return MERGE

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        hd = self.case_smallest_head_dim(k)  # one dim a row, the edges over a partial block
        return [Case(f"hd{hd}_smallest", n=3, n_head=5, head_dim=hd, lse_pattern="edges"),
                Case(f"hd{hd}_smallest_ctx1", n=3, n_head=1, head_dim=hd,
                     prefill_tokens_with_context=1)]

    def gpu_check(self, k, fn, case) -> None:
        from kgen.testing import merge

        return merge.check(k, fn, case)


OP = MergeAttnStates()
