"""The op ``decode_combine``: merge split-decode partials into the output."""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class DecodeCombine(OpDef):
    op = Op.DECODE_COMBINE

    # --- spec: axes and checks
    planned = True

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases
    mutated_array = "out"

    def contract_args(self, k, case, alloc) -> dict:
        import numpy as np

        from kgen.ir.axes import Position, Sinks

        z, f32, hd = alloc, np.float32, case.head_dim
        pos = np.array(case.positions or (case.seq_len - 1,), dtype=np.int32)
        S = case.cap
        a = dict(m_in=z(case.n_head * S, f32), l_in=z(case.n_head * S, f32),
                 acc_in=z(case.n_head * S * hd, f32), out=z((case.n_head, hd), f32))
        if k.sinks is Sinks.LEARNED:
            a["sinks"] = z((case.n_head,), f32)
        if k.position is Position.HOST:
            a["n_splits"] = S
        else:
            a.update(pos=pos, kps=case.kps, splits_cap=case.cap)
        return a

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.ir.axes import Sinks
        from kgen.ir.geometry import combine_staged
        from kgen.testing.arguments import (
            Makers,
            Mutation,
            always,
            argument_mutations,
            layout_mutations,
        )

        m = Makers(self)
        return {
            **argument_mutations(self),
            "sinks_wrong_size": Mutation("shape", lambda k: k.sinks is Sinks.LEARNED,
                                         lambda k, c: {**m.args(k, c),
                                                       "sinks": np.zeros(1, np.float32)}),
            "head_dim_over_block": Mutation("block size", lambda k: not combine_staged(k),
                                            m.big_head_dim),
            **layout_mutations(self),
            "partials_too_small": Mutation("partials size", always, lambda k, c: {
                **m.args(k, c), "acc_in": np.zeros(8, np.float32)}),
        }

    def mutated_integer(self, k) -> str | None:
        from kgen.ir.axes import Position

        return "n_splits" if k.position is Position.HOST else "kps"

    def case_candidates(self, k) -> list:
        from kgen.testing.shapes import COMBINE

        return COMBINE

    def case_required(self, k) -> list:
        from kgen.ir.axes import Sinks
        from kgen.testing.case import Case

        hd, T = self.case_smallest_head_dim(k), k.tile_keys
        base = Case(f"hd{hd}_smallest", n_head=3, head_dim=hd, n_splits=2, seq_len=2 * T + 3,
                    kps=T, cap=4)
        return [base, *([base.with_(name=f"{base.name}_sinks", sinks=True)]
                        if k.sinks is Sinks.LEARNED else [])]

    def gpu_check(self, k, fn, case) -> None:
        from kgen.testing import gpu

        return gpu.check_combine(k, fn, case)

    def gpu_relation(self, kind: str, tolerance: float, ka, fa, kb, fb, case) -> None:
        from kgen.testing import gpu

        return gpu.combine_relation(kind, tolerance, ka, fa, kb, fb, case)


OP = DecodeCombine()
