"""The op ``qz_split``: split the joint q+gate projection."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from kgen.ir.axes import Op
from kgen.ir.params import INT_MAX
from kgen.ir.signature import fixed
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker


class QzSplit(OpDef):
    op = Op.QZ_SPLIT

    # --- spec: axes and checks

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        return (fixed("const float *", "qg") + fixed("float *", "q", "z")
                + fixed("int", "head_dim", "total"))

    def validates_pos(self, k: Kernel) -> bool:
        return False  # its kernels read no positions, whatever the position axis says

    # --- render
    takes_head_dim = False

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        from kgen.runtime.checks import QZ_BLOCK

        return QZ_BLOCK, 0  # a fixed block, no head_dim

    # --- binding and launch
    def bind(self, k: Kernel, c: Checker, a: dict):
        """qg [..., 2 * head_dim] into q and z [..., head_dim] (float32): a 1-D launch of
        QZ_BLOCK-thread blocks over every element."""
        from kgen.runtime.checks import QZ_BLOCK, block_registers

        qg, q, z = a["qg"], a["q"], a["z"]
        for name in ("qg", "q", "z"):
            c.array(name, a[name], np.float32)
        hd = int(q.shape[-1]) if q.ndim else 0
        c.require(hd >= 1, "shape", "q must have a last (head_dim) axis")
        c.shape("z", z, tuple(q.shape))
        c.shape("qg", qg, (*q.shape[:-1], 2 * hd))
        total = int(np.prod(q.shape))
        c.require(total >= 1, "shape", "nothing to split")
        blocks = math.ceil(total / QZ_BLOCK)
        block_registers(k, c, QZ_BLOCK, None)
        c.require(blocks * QZ_BLOCK <= INT_MAX, "int32 index",
                  lambda: f"{total} elements overflow the kernel's int thread index")
        values = dict(qg=qg, q=q, z=z, head_dim=hd, total=total)
        return (blocks, 1, 1), (QZ_BLOCK, 1, 1), 0, values

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

    def gpu_check(self, k, fn, case, find) -> None:
        from kgen.testing import gpu

        return gpu.check_qz(k, fn, case)


OP = QzSplit()
