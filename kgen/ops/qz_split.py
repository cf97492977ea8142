"""The op ``qz_split``: split the joint q+gate projection."""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class QzSplit(OpDef):
    op = Op.QZ_SPLIT

    # --- spec: axes and checks

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases
    mutated_array = "q"

    def contract_args(self, k, case, alloc) -> dict:
        import numpy as np

        z, f32, hd = alloc, np.float32, case.head_dim
        return dict(qg=z((case.n, case.n_head, 2 * hd), f32), q=z((case.n, case.n_head, hd), f32),
                    z=z((case.n, case.n_head, hd), f32))

    def contract_mutations(self) -> dict:
        import numpy as np

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
            "qz_int32_index": Mutation("int32 index", always,
                                       m.shape_only(n=2**16, n_head=2**8, head_dim=2**8)),
            **layout_mutations(self),
            "qz_shape_mismatch": Mutation("shape", always, m.replace(
                "z", lambda a, k, c: np.zeros((*a.shape[:-1], a.shape[-1] - 1), a.dtype))),
        }

    def case_candidates(self, k) -> list:
        from kgen.testing.shapes import QZ

        return QZ

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        hd = self.case_smallest_head_dim(k)
        return [Case(f"hd{hd}_smallest", n=3, n_head=5, head_dim=hd)]

    def gpu_check(self, k, fn, case) -> None:
        from kgen.testing import gpu

        return gpu.check_qz(k, fn, case)


OP = QzSplit()
