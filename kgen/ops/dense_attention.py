"""The op ``dense_attention``: the engine's AttentionDenseFast / AttentionDenseFlash: one
sequence, a warp per (query, q head).
"""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class DenseAttention(OpDef):
    op = Op.DENSE_ATTENTION

    # --- spec: axes and checks
    in_dtype = True
    out_dtype = True

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases
    mutated_array = "query"

    def contract_args(self, k, case, alloc) -> dict:
        from kgen.testing import dense

        return dense.host_args(k, case, alloc)

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.testing.arguments import Makers, Mutation, ShapeOnly, always, grown

        m = Makers(self)

        def other_dtype(a, c):
            """The same shape in the element type the kernel does not take (f32 <-> bf16)."""
            return np.zeros(a.shape, np.uint16 if a.dtype == np.float32 else np.float32)
        return {
            **super().contract_mutations(),
            "dense_head_dim_over_max": Mutation("head_dim range", always, lambda k, c: m.args(
                k, c.with_(head_dim=k.max_head_dim + 1))),
            "dense_gqa_mismatch": Mutation("GQA", always, m.at(n_head=7, n_head_kv=2)),
            "dense_out_shape": Mutation("shape", always, m.replace_from_case("out", grown(1))),
            "dense_out_rows": Mutation("shape", always, m.replace_from_case("out", grown(0))),
            "dense_key_rows_mismatch": Mutation("shape", always, m.replace_from_case(
                "key", grown(0))),
            "dense_value_heads_mismatch": Mutation("shape", always, m.replace_from_case(
                "value", grown(1))),
            "dense_key_head_dim_mismatch": Mutation("shape", always, m.replace_from_case(
                "key", grown(2))),
            "dense_no_kv_heads": Mutation("shape", always, m.replace_from_case(
                "key", lambda a, c: np.zeros((a.shape[0], 0, a.shape[2]), a.dtype))),
            "dense_query_2d": Mutation("shape", always, m.replace_from_case(
                "query", lambda a, c: a.reshape(a.shape[0], -1))),
            "dense_no_rows": Mutation("shape", always, m.replace_from_case(
                "query", lambda a, c: a[:0].copy())),
            "dense_key_dtype": Mutation("dtype", always, m.replace_from_case(
                "key", other_dtype)),
            "dense_value_dtype": Mutation("dtype", always, m.replace_from_case(
                "value", other_dtype)),
            "dense_out_dtype": Mutation("dtype", always, m.replace_from_case(
                "out", other_dtype)),
            "dense_causal_range": Mutation("range", always, lambda k, c: {
                **m.args(k, c), "block_causal": 2}),
            "dense_scale_not_finite": Mutation("scale", always, lambda k, c: {
                **m.args(k, c), "scale": float("nan")}),
            "dense_scale_not_positive": Mutation("scale", always, lambda k, c: {
                **m.args(k, c), "scale": -1.0}),
            "dense_int32_rows": Mutation("int32 index", always, lambda k, c: m.args(
                k, c.with_(n=2**27, n_head=16, n_head_kv=16, head_dim=1), alloc=ShapeOnly)),
        }

    def mutated_integer(self, k) -> str | None:
        return "block_causal"

    def case_candidates(self, k) -> list:
        from kgen.testing.shapes import DENSE

        return DENSE

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        # one dim a row, GQA, past two tiles, partial blocks
        hd, n = self.case_smallest_head_dim(k), 2 * k.tile_keys + 3
        return [Case(f"hd{hd}_smallest", n=n, n_head=3, n_head_kv=1, head_dim=hd),
                Case(f"hd{hd}_smallest_causal", n=n, n_head=3, n_head_kv=1, head_dim=hd,
                     causal=True),
                Case(f"hd{k.max_head_dim}_widest_causal", n=n, n_head=2, n_head_kv=2,
                     head_dim=k.max_head_dim, causal=True)]

    def gpu_check(self, k, fn, case) -> None:
        from kgen.testing import dense

        return dense.check(k, fn, case)

    def gpu_relation(self, kind: str, tolerance: float, ka, fa, kb, fb, case) -> None:
        from kgen.testing import dense

        return dense.relation(kind, tolerance, ka, fa, kb, fb, case)


OP = DenseAttention()
