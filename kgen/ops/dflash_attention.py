"""The op ``dflash_attention``: the engine's DFlash block attention: each query attends only
its request's block (and, paged, its context).
"""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class DflashAttention(OpDef):
    op = Op.DFLASH_ATTENTION

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
        from kgen.testing import dflash

        return dflash.host_args(k, case, alloc)

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.ir.params import INT_MAX
        from kgen.testing.arguments import (
            Makers,
            Mutation,
            ShapeOnly,
            always,
            grown,
            other_elem,
        )
        from kgen.testing.dflash import paged

        m = Makers(self)

        def keys(k) -> tuple[str, str]:
            """The names of the block's key and value rows."""
            return ("block_key", "block_value") if paged(k) else ("key", "value")
        return {
            **super().contract_mutations(),
            "dflash_head_dim_over_max": Mutation("head_dim range", always, lambda k, c: m.args(
                k, c.with_(head_dim=k.max_head_dim + 1))),
            "dflash_gqa_mismatch": Mutation("GQA", always, m.at(n_head=7, n_head_kv=2)),
            "dflash_out_shape": Mutation("shape", always, m.replace_from_case(
                "out", grown(1))),
            "dflash_key_rows_mismatch": Mutation("shape", always, m.replace_from_case(
                lambda k: keys(k)[0], grown(0))),
            "dflash_value_heads_mismatch": Mutation("shape", always, m.replace_from_case(
                lambda k: keys(k)[1], grown(1))),
            "dflash_key_head_dim_mismatch": Mutation("shape", always, m.replace_from_case(
                lambda k: keys(k)[0], grown(2))),
            # one element type for query and every key / value array (in_dtype), out's own
            "dflash_key_elem": Mutation("dtype", always, m.replace_from_case(
                lambda k: keys(k)[0], other_elem)),
            "dflash_value_elem": Mutation("dtype", always, m.replace_from_case(
                lambda k: keys(k)[1], other_elem)),
            "dflash_query_elem": Mutation("dtype", always, m.replace_from_case(
                "query", other_elem)),
            "dflash_out_elem": Mutation("dtype", always, m.replace_from_case("out", other_elem)),
            "dflash_ctx_value_elem": Mutation("dtype", paged, m.replace_from_case(
                "ctx_value", other_elem)),
            "dflash_cu_seqlens_dtype": Mutation("dtype", always, m.replace_from_case(
                "cu_seqlens", lambda a, c: a.astype(np.int64))),
            "dflash_cu_seqlens_2d": Mutation("shape", always, m.replace_from_case(
                "cu_seqlens", lambda a, c: a.reshape(1, -1))),
            "dflash_no_requests": Mutation("shape", always, m.replace_from_case(
                "cu_seqlens", lambda a, c: a[:1].copy())),
            "dflash_causal_range": Mutation("range", always, lambda k, c: {
                **m.args(k, c), "block_causal": 2}),
            "dflash_window_over_int": Mutation("range", always, lambda k, c: {
                **m.args(k, c), "sliding_window": INT_MAX + 1}),
            "dflash_scale_not_finite": Mutation("scale", always, lambda k, c: {
                **m.args(k, c), "scale": float("inf")}),
            "dflash_scale_not_positive": Mutation("scale", always, lambda k, c: {
                **m.args(k, c), "scale": 0.0}),
            "dflash_int32_rows": Mutation("int32 index", always, lambda k, c: m.args(
                k, c.with_(requests=((2**27, 0),), n_head=16, n_head_kv=16, head_dim=1),
                alloc=ShapeOnly)),
            "dflash_ctx_pages_mismatch": Mutation("shape", paged, m.replace_from_case(
                "ctx_value", grown(1))),
            "dflash_ctx_heads_mismatch": Mutation("shape", paged, m.replace_from_case(
                "ctx_key", grown(2))),
            "dflash_seq_lens_size": Mutation("shape", paged, m.replace_from_case(
                "seq_lens", grown(0))),
            "dflash_block_table_rows": Mutation("shape", paged, m.replace_from_case(
                "block_table", grown(0))),
            "dflash_block_table_no_columns": Mutation("shape", paged, m.replace_from_case(
                "block_table", lambda a, c: np.zeros((a.shape[0], 0), a.dtype))),
            "dflash_block_table_dtype": Mutation("dtype", paged, m.replace_from_case(
                "block_table", lambda a, c: a.astype(np.int64))),
            "dflash_pages_int32_position": Mutation("int32 position", paged, lambda k, c: {
                **m.args(k, c), **{n: ShapeOnly((2**20, 2**12, c.n_head_kv, c.head_dim),
                                               np.dtype(k.in_dtype.fmt.dtype))
                                   for n in ("ctx_key", "ctx_value")}}),
            "dflash_table_int32_position": Mutation("int32 position", paged, m.replace_from_case(
                "block_table", lambda a, c: ShapeOnly((a.shape[0], 2**31 // c.block_size),
                                                      a.dtype))),
        }

    def mutated_integer(self, k) -> str | None:
        return "sliding_window"

    def case_candidates(self, k) -> list:
        from kgen.ir.axes import KeySource
        from kgen.testing.shapes import DFLASH_DENSE, DFLASH_PAGED

        return DFLASH_PAGED if k.key_source is KeySource.PAGED else DFLASH_DENSE

    def case_required(self, k) -> list:
        from kgen.ir.axes import KeySource
        from kgen.testing.case import Case

        # one dim a row, GQA, a partial block of warps
        hd = self.case_smallest_head_dim(k)
        ctx = 3 if k.key_source is KeySource.PAGED else 0
        return [Case(f"hd{hd}_smallest", requests=((3, ctx), (2, ctx + 2)), n_head=3,
                     n_head_kv=1, head_dim=hd, block_size=2),
                Case(f"hd{hd}_smallest_causal", requests=((3, ctx), (2, ctx + 2)), n_head=3,
                     n_head_kv=1, head_dim=hd, block_size=2, causal=True),
                Case(f"hd{k.max_head_dim}_widest_causal_win2", requests=((5, ctx),), n_head=2,
                     n_head_kv=2, head_dim=k.max_head_dim, block_size=2, causal=True,
                     sliding_window=2)]

    def gpu_check(self, k, fn, case) -> None:
        from kgen.testing import dflash

        return dflash.check(k, fn, case)


OP = DflashAttention()
