"""The op ``mla_decode``: MLA decode, split stage: (m, l, acc) per key split."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kgen.ir.axes import Op
from kgen.ir.geometry import MLA_THREADS
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker


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
    def render_flags(self, k) -> frozenset[str]:
        return frozenset({"mla"})  # the split bounds

    def template_parts(self, k) -> tuple[str, ...]:
        return ("kernels/mla_parts.j2",)

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, all its shared memory static
        return self.mla_threads(k), 0

    # --- binding and launch
    entries = ("mla_decode_attention",)  # kgen.runtime's public calls

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        from kgen.runtime.checks import check_mla_shape

        check_mla_shape(k, c, hd, self.mla_width())

    def bind(self, k: Kernel, c: Checker, a: dict):
        """The split stage of a decode: query [B][Hq][MLA_ROW] over each request's paged
        latent rows (block_table, seq_lens), each key split's (m, l, acc) partials."""
        from kgen.ir.geometry import MLA_ROW, MLA_THREADS, mla_decode_grid
        from kgen.runtime.checks import (
            aligned,
            block_registers,
            elem,
            host_ints,
            latent_pages,
            mla_lens,
            mla_partials,
            mla_tables,
            mla_used_blocks,
            param,
        )

        q = a["query"]
        c.array("query", q, elem(k.in_dtype), 3)
        B, H = (int(n) for n in q.shape[:2])
        c.shape("query", q, (B, H, MLA_ROW))
        c.require(B >= 1 and H >= 1, "shape", lambda: f"query has shape {tuple(q.shape)}")
        nb, bs = latent_pages(k, c, "kv_cache", a["kv_cache"])
        aligned(c, "kv_cache", a["kv_cache"])
        _, mb = mla_tables(c, a, B)
        mla_lens(c, a, B)
        if a.get("validate_pos", True):
            lens, table = host_ints(a["seq_lens"]), host_ints(a["block_table"])
            for r, n in enumerate(lens):
                mla_used_blocks(c, table, r, 0, int(n), nb, bs)
        S = mla_partials(c, a, ("m_out", "l_out", "acc_out"), B, H)
        block_registers(k, c, MLA_THREADS, None)
        values = dict(query=q, kv_cache=a["kv_cache"], block_table=a["block_table"],
                      seq_lens=a["seq_lens"], m_out=a["m_out"], l_out=a["l_out"],
                      acc_out=a["acc_out"], n_head=H, kv_splits=S, num_blocks=nb, block_size=bs,
                      max_blocks=mb, scale=param(c, a, "scale", 1.0 / math.sqrt(MLA_ROW)))
        return mla_decode_grid(H, S, B), (MLA_THREADS, 1, 1), 0, values

    # --- C++ view
    def cpp_roles(self) -> dict:
        return {"mla_decode": self.role()}

    # --- contracts, reference and test cases


OP = MlaDecode()
