"""The op ``mla_prefill``: MLA prefill: the engine's MlaPrefillAttention, varlen attention, QK
192, V 128.
"""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class MlaPrefill(OpDef):
    op = Op.MLA_PREFILL

    # --- spec: axes and checks
    mla = True
    in_dtype = True
    out_dtype = True

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases
    mutated_array = "query"

    def contract_args(self, k, case, alloc) -> dict:
        import math

        import numpy as np

        from kgen.ir.axes import Lse
        from kgen.ir.geometry import MLA_PREFILL_QK, MLA_PREFILL_V
        from kgen.testing.mla import elems, prefill_layout

        z, (ei, eo) = alloc, elems(k)
        lay = prefill_layout(case)
        Tq, Tk = int(lay["cu_seqlens_q"][-1]), int(lay["cu_seqlens_k"][-1])
        H = case.n_head
        a = dict(query=z((Tq, H, MLA_PREFILL_QK), ei), key=z((Tk, H, MLA_PREFILL_QK), ei),
                 value=z((Tk, H, MLA_PREFILL_V), ei), cu_seqlens_q=lay["cu_seqlens_q"],
                 cu_seqlens_k=lay["cu_seqlens_k"], out=z((Tq, H, MLA_PREFILL_V), eo),
                 max_seqlen_q=lay["max_seqlen_q"], scale=1.0 / math.sqrt(MLA_PREFILL_QK))
        if k.lse is Lse.WRITE:
            a["lse"] = z((H, Tq), np.float32)
        return a

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.ir.axes import Lse
        from kgen.testing.arguments import (
            Makers,
            Mutation,
            always,
            other_elem,
            zeros_like_shape,
        )

        m = Makers(self)
        return {
            **super().contract_mutations(),
            # q, K and V of in_dtype, out of out_dtype
            "mla_prefill_value_elem": Mutation("dtype", always, m.replace_from_args(
                "value", other_elem)),
            "mla_prefill_out_elem": Mutation("dtype", always, m.replace_from_args(
                "out", other_elem)),
            "mla_prefill_key_width": Mutation("shape", always, m.replace_from_args(
                "key", zeros_like_shape(lambda s: (s[0], s[1], s[2] - 64)))),
            "mla_prefill_value_rows": Mutation("shape", always, m.replace_from_args(
                "value", zeros_like_shape(lambda s: (s[0] + 1, s[1], s[2])))),
            "mla_prefill_heads_mismatch": Mutation("shape", always, m.replace_from_args(
                "key", zeros_like_shape(lambda s: (s[0], s[1] + 1, s[2])))),
            "mla_prefill_out_width": Mutation("shape", always, m.replace_from_args(
                "out", zeros_like_shape(lambda s: (s[0], s[1], s[2] + 64)))),
            "mla_prefill_cu_k_size": Mutation("shape", always, m.replace_from_args(
                "cu_seqlens_k", lambda x, a: np.zeros(x.size + 1, x.dtype))),
            "mla_prefill_lse_transposed": Mutation(
                "lse layout", lambda k: k.lse is Lse.WRITE,
                m.replace_from_args("lse", zeros_like_shape(lambda s: s[::-1]),
                                    requests=((5, 5),), n_head=3)),
            "mla_prefill_max_seqlen_q_over_rows": Mutation(
                "max_seqlen_q", always, m.replace_from_args(
                    "max_seqlen_q", lambda x, a: int(a["query"].shape[0]) + 1)),
            "mla_prefill_max_seqlen_q_short": Mutation(
                "max_seqlen_q", always, m.replace_from_args(
                    "max_seqlen_q", lambda x, a: x - 1, requests=((1, 1), (3, 3)))),
            "mla_prefill_cu_q_not_rising": Mutation(
                "cu_seqlens_q", always, m.replace_from_args(
                    "cu_seqlens_q", lambda x, a: x[::-1].copy(), requests=((1, 1), (3, 3)))),
            "mla_prefill_cu_k_past_rows": Mutation("cu_seqlens_k", always, m.replace_from_args(
                "cu_seqlens_k", lambda x, a: x * 2)),
            "mla_prefill_rows_over_int": Mutation("int32 index", always, m.shape_only(
                requests=((2**16, 2**16),), n_head=2**15 + 1)),
            "mla_prefill_scale_not_finite": Mutation("scale", always, m.replace_from_args(
                "scale", lambda x, a: float("nan"))),
        }

    def case_candidates(self, k) -> list:
        from kgen.testing.mla import PREFILL

        return PREFILL

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        return [Case("mla_smallest", requests=((1, 1),), n_head=1)]  # the smallest launch

    def gpu_check(self, k, fn, case) -> None:
        from kgen.testing import mla

        return mla.check_prefill(k, fn, case)


OP = MlaPrefill()
