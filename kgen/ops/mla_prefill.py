"""The op ``mla_prefill``: MLA prefill: the engine's MlaPrefillAttention, varlen attention, QK
192, V 128.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Lse, Op
from kgen.ir.geometry import MLA_PREFILL_QK, MLA_PREFILL_ROWS
from kgen.ir.pyapi import PyArg
from kgen.ir.signature import elems, fixed
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class MlaPrefill(OpDef):
    op = Op.MLA_PREFILL

    # --- spec: axes and checks
    mla = True
    in_dtype = True
    out_dtype = True
    own_keys = frozenset({"mask", "lse"})

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        # the engine's MlaPrefillAttention; lse [n_head][total_q]
        out = elems(k.in_dtype, "const ", "query", "key", "value")
        out += fixed("const int *", "cu_seqlens_q", "cu_seqlens_k")
        out += elems(k.out_dtype, "", "out")
        out += fixed("float *", *(["lse"] if k.lse is Lse.WRITE else []))
        out += fixed("int", "n_head", "num_reqs", "total_q") + fixed("float", "scale")
        return out

    def host_bounds(self, k: Kernel) -> list[PyArg]:
        return [PyArg("max_seqlen_q", "int")]  # host bound: the grid

    def mla_width(self) -> int:
        return MLA_PREFILL_QK  # its q.k head size

    def mla_threads(self, k: Kernel) -> int:
        return MLA_PREFILL_ROWS * TARGET.warp

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = MlaPrefill()
