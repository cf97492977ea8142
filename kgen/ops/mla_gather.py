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

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases
    mutated_array = "dst"

    def contract_args(self, k, case, alloc) -> dict:
        from kgen.ir.axes import SeqStarts
        from kgen.ir.geometry import MLA_ROW
        from kgen.testing.mla import elems, gather_layout, layout

        z, (ei, _) = alloc, elems(k)
        lay = layout(case)
        pages = z((lay["num_blocks"], case.block_size, MLA_ROW), ei)
        gl = gather_layout(case)
        a = dict(dst=z((gl["num_tokens"], MLA_ROW), ei), src_cache=pages,
                 block_table=lay["block_table"], cu_seq_lens=gl["cu_seq_lens"],
                 token_to_seq=gl["token_to_seq"], num_tokens=gl["num_tokens"])
        if k.seq_starts is SeqStarts.GIVEN:
            a["seq_starts"] = gl["seq_starts"]
        return a

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.ir.axes import SeqStarts
        from kgen.testing.arguments import (
            Makers,
            Mutation,
            always,
            other_elem,
            zeros_like_shape,
        )

        m = Makers(self)

        def given(k) -> bool:
            return k.seq_starts is SeqStarts.GIVEN
        return {
            **super().contract_mutations(),
            # one element type for the workspace and the cache (in_dtype)
            "mla_gather_dst_elem": Mutation("dtype", always, m.replace_from_args(
                "dst", other_elem)),
            "mla_gather_tokens_over_dst": Mutation("shape", always, m.replace_from_args(
                "num_tokens", lambda x, a: x + 1)),
            "mla_gather_tokens_over_map": Mutation("shape", always, m.replace_from_args(
                "token_to_seq", lambda x, a: x[:-1].copy())),
            "mla_gather_no_tokens": Mutation("range", always, m.replace_from_args(
                "num_tokens", lambda x, a: 0)),
            "mla_gather_cu_size": Mutation("shape", always, m.replace_from_args(
                "cu_seq_lens", lambda x, a: x[:-1].copy())),
            "mla_gather_dst_width": Mutation("shape", always, m.replace_from_args(
                "dst", zeros_like_shape(lambda s: (s[0], s[1] + 1)))),
            "mla_gather_src_rank": Mutation("shape", always, m.replace_from_args(
                "src_cache", zeros_like_shape(lambda s: (s[0], s[1], 1, s[2])))),
            "mla_gather_table_int64": Mutation("dtype", always, m.replace_from_args(
                "block_table", lambda x, a: x.astype(np.int64))),
            "mla_gather_starts_size": Mutation("shape", given, m.replace_from_args(
                "seq_starts", lambda x, a: np.zeros(x.size + 1, x.dtype))),
            "mla_gather_start_not_block": Mutation("seq_starts", given, m.replace_from_args(
                "seq_starts", lambda x, a: x + 1, requests=((2, 9),), block_size=4)),
            "mla_gather_token_wrong_seq": Mutation("token_to_seq", always, m.replace_from_args(
                "token_to_seq", lambda x, a: x[::-1].copy(), requests=((2, 2), (1, 1)))),
            "mla_gather_cu_not_rising": Mutation("cu_seq_lens", always, m.replace_from_args(
                "cu_seq_lens", lambda x, a: x + 1)),
            "mla_gather_block_outside": Mutation("block_table", always, m.replace_from_args(
                "block_table", lambda x, a: x + 10**6)),
            "mla_gather_row_past_table": Mutation("block_table", always, m.replace_from_args(
                "block_table", lambda x, a: x[:, :1].copy(), requests=((3, 3),),
                block_size=2)),
        }

    def mutated_integer(self, k) -> str | None:
        return "num_tokens"

    def case_candidates(self, k) -> list:
        from kgen.ir.axes import SeqStarts
        from kgen.testing.mla import GATHER, GATHER_STARTS

        return GATHER_STARTS + GATHER if k.seq_starts is SeqStarts.GIVEN else GATHER

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        return [Case("mla_smallest", requests=((1, 1),), block_size=1)]  # the smallest launch

    def gpu_check(self, k, fn, case) -> None:
        from kgen.testing import mla

        return mla.check_gather(k, fn, case)


OP = MlaGather()
