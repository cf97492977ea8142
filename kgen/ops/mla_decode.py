"""The op ``mla_decode``: MLA decode, split stage: (m, l, acc) per key split."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Op
from kgen.ir.geometry import MLA_THREADS
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class MlaDecode(OpDef):
    op = Op.MLA_DECODE

    # --- spec: axes and checks
    mla = True
    in_dtype = True

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        # split stage: partials [B][Hq][kv_splits] (acc x V width)
        out = elems(k.in_dtype, "const ", "query", "kv_cache")
        out += fixed("const int *", "block_table", "seq_lens")
        out += fixed("float *", "m_out", "l_out", "acc_out")
        out += fixed("int", "n_head", "kv_splits", "num_blocks", "block_size", "max_blocks")
        out += fixed("float", "scale")
        return out

    def mla_threads(self, k: Kernel) -> int:
        return MLA_THREADS

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = MlaDecode()
