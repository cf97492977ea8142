"""The op ``mla_combine``: MLA decode, merge stage: the splits in ascending order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Lse, Op
from kgen.ir.geometry import MLA_COMBINE_THREADS, MLA_LATENT
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class MlaCombine(OpDef):
    op = Op.MLA_COMBINE

    # --- spec: axes and checks
    mla = True
    out_dtype = True
    own_keys = frozenset({"lse"})

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:  # merge stage, the splits in ascending order
        out = fixed("const float *", "m_in", "l_in", "acc_in") + fixed("const int *", "seq_lens")
        out += elems(k.out_dtype, "", "out")
        out += fixed("float *", *(["lse"] if k.lse is Lse.WRITE else []))
        out += fixed("int", "n_head", "kv_splits")
        return out

    def mla_width(self) -> int:
        return MLA_LATENT  # the merge stage's rows are V rows

    def mla_threads(self, k: Kernel) -> int:
        return MLA_COMBINE_THREADS

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = MlaCombine()
