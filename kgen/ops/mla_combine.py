"""The op ``mla_combine``: MLA decode, merge stage: the splits in ascending order."""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class MlaCombine(OpDef):
    op = Op.MLA_COMBINE

    # --- spec: axes and checks
    mla = True
    out_dtype = True

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases
    mutated_array = "out"

    def contract_args(self, k, case, alloc) -> dict:
        import numpy as np

        from kgen.ir.axes import Lse
        from kgen.ir.geometry import MLA_LATENT
        from kgen.testing.mla import elems, layout

        z, f32, (_, eo) = alloc, np.float32, elems(k)
        lay = layout(case)
        B, H, S = len(case.requests), case.n_head, case.n_splits
        a = dict(m_in=z((B, H, S), f32), l_in=z((B, H, S), f32),
                 acc_in=z((B, H, S, MLA_LATENT), f32), seq_lens=lay["seq_lens"],
                 out=z((B, H, MLA_LATENT), eo))
        if k.lse is Lse.WRITE:
            a["lse"] = z((B, H), f32)
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
        from kgen.testing.mla import partials_mutations

        m = Makers(self)
        return {
            **super().contract_mutations(),
            # out of its own element type (out_dtype)
            "mla_combine_out_elem": Mutation("dtype", always, m.replace_from_args(
                "out", other_elem)),
            **partials_mutations(self, "m_in", "l_in", "acc_in"),
            "mla_combine_out_width": Mutation("shape", always, m.replace_from_args(
                "out", zeros_like_shape(lambda s: (s[0], s[1], s[2] + 64)))),
            "mla_combine_lse_layout": Mutation(
                "shape", lambda k: k.lse is Lse.WRITE,
                m.replace_from_args("lse", zeros_like_shape(lambda s: s[::-1]), n_head=3)),
            "mla_combine_seq_len_zero": Mutation("seq_lens", always, m.replace_from_args(
                "seq_lens", lambda x, a: np.zeros_like(x))),
            "mla_combine_rows_over_int": Mutation("int32 index", always, m.shape_only(
                requests=((1, 1),) * 2**16, n_head=2**15, n_splits=1)),
        }

    def case_candidates(self, k) -> list:
        from kgen.testing.mla import DECODE

        return DECODE

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        return [Case("mla_smallest", requests=((1, 1),), n_head=1, n_splits=1, block_size=1)]

    def gpu_check(self, k, fn, case) -> None:
        from kgen.testing import mla

        return mla.check_combine(k, fn, case)


OP = MlaCombine()
