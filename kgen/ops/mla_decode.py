"""The op ``mla_decode``: MLA decode, split stage: (m, l, acc) per key split."""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class MlaDecode(OpDef):
    op = Op.MLA_DECODE

    # --- spec: axes and checks
    mla = True
    in_dtype = True

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases
    mutated_array = "query"

    def contract_args(self, k, case, alloc) -> dict:
        import math

        import numpy as np

        from kgen.ir.geometry import MLA_LATENT, MLA_ROW
        from kgen.testing.mla import elems, layout

        z, f32, (ei, _) = alloc, np.float32, elems(k)
        lay = layout(case)
        pages = z((lay["num_blocks"], case.block_size, MLA_ROW), ei)
        B, H, S = len(case.requests), case.n_head, case.n_splits
        return dict(query=z((B, H, MLA_ROW), ei), kv_cache=pages,
                    block_table=lay["block_table"], seq_lens=lay["seq_lens"],
                    m_out=z((B, H, S), f32), l_out=z((B, H, S), f32),
                    acc_out=z((B, H, S, MLA_LATENT), f32), scale=1.0 / math.sqrt(MLA_ROW))

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.testing.arguments import (
            Makers,
            Mutation,
            always,
            huge_pages,
            other_elem,
            zeros_like_shape,
        )
        from kgen.testing.mla import partials_mutations

        m = Makers(self)
        return {
            **super().contract_mutations(),
            # one element type for the queries and the cache (in_dtype)
            "mla_decode_query_elem": Mutation("dtype", always, m.replace_from_args(
                "query", other_elem)),
            "mla_decode_query_width": Mutation("shape", always, m.replace_from_args(
                "query", zeros_like_shape(lambda s: (s[0], s[1], s[2] - 64)))),
            "mla_decode_table_rows": Mutation("shape", always, m.replace_from_args(
                "block_table", zeros_like_shape(lambda s: (s[0] + 1, s[1])))),
            "mla_decode_cache_width": Mutation("shape", always, m.replace_from_args(
                "kv_cache", zeros_like_shape(lambda s: (s[0], s[1], s[2] + 1)))),
            "mla_decode_positions_overflow": Mutation("int32 position", always,
                                                      m.replace_from_args("kv_cache",
                                                                          huge_pages)),
            "mla_decode_scale_not_finite": Mutation("scale", always, m.replace_from_args(
                "scale", lambda x, a: float("inf"))),
            "mla_decode_scale_not_positive": Mutation("scale", always, m.replace_from_args(
                "scale", lambda x, a: 0.0)),
            "mla_decode_seq_len_zero": Mutation("seq_lens", always, m.replace_from_args(
                "seq_lens", lambda x, a: np.zeros_like(x))),
            "mla_decode_seq_past_table": Mutation("block_table", always, m.replace_from_args(
                "seq_lens", lambda x, a: x + 10**6)),
            "mla_decode_block_outside": Mutation("block_table", always, m.replace_from_args(
                "block_table", lambda x, a: x + 10**6)),
            "mla_decode_splits_over_grid": Mutation("grid", always, m.shape_only(
                n_splits=2**16)),
            **partials_mutations(self, "m_out", "l_out", "acc_out"),
        }

    def case_candidates(self, k) -> list:
        from kgen.testing.mla import DECODE

        return DECODE

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        return [Case("mla_smallest", requests=((1, 1),), n_head=1, n_splits=1, block_size=1)]

    def gpu_check(self, k, fn, case) -> None:
        from kgen.testing import mla

        return mla.check_decode(k, fn, case)


OP = MlaDecode()
