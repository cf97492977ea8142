"""The op ``mla_decode``: MLA decode, split stage: (m, l, acc) per key split."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kgen.ir.axes import Op
from kgen.ir.geometry import MLA_THREADS
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef, PublicCall

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
        out = elems(k.in_dtype, "const ", "query")
        # latent rows read a quad a load (the format's load_quad)
        out += elems(k.in_dtype, "const ", "kv_cache", align=k.in_dtype.fmt.quad_bytes)
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
    # (its combine's kernels run in the same call: this op describes it)
    public_calls = (PublicCall("mla_decode_attention", writes=("out", "lse"),
                               optional=("lse",)),)

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        from kgen.runtime.checks import check_mla_shape

        check_mla_shape(k, c, hd, self.mla_width())

    def bind(self, k: Kernel, c: Checker, a: dict):
        """The split stage of a decode: query [B][Hq][MLA_ROW] over each request's paged
        latent rows (block_table, seq_lens), each key split's (m, l, acc) partials."""
        from kgen.ir.geometry import MLA_ROW, MLA_THREADS, mla_decode_grid
        from kgen.runtime.checks import (
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
    mutated_array = "query"

    def contract_args(self, k, case, alloc) -> dict:
        import math

        import numpy as np

        from kgen.ir.geometry import MLA_LATENT, MLA_ROW
        from kgen.testing.mla import elems, layout

        z, f32, (ei, _) = alloc, np.float32, elems(k)
        lay = layout(case)
        pages = z((lay["num_blocks"], case.block_size, MLA_ROW), ei)
        B, H, S = len(case.requests), case.n_head, case.n_splits
        return dict(query=z((B, H, MLA_ROW), ei), kv_cache=pages,
                    block_table=lay["block_table"], seq_lens=lay["seq_lens"],
                    m_out=z((B, H, S), f32), l_out=z((B, H, S), f32),
                    acc_out=z((B, H, S, MLA_LATENT), f32), scale=1.0 / math.sqrt(MLA_ROW))

    def call_args(self, call: str, k, case, alloc) -> dict | None:
        """mla_decode_attention over the decode's case: its queries, pages, table and
        lengths; out and lse (the combine's) of the queries' element type, its splits."""
        import numpy as np

        from kgen.ir.geometry import MLA_LATENT

        a = self.contract_args(k, case, alloc)
        B, H = (int(n) for n in a["query"].shape[:2])
        return dict(out=alloc((B, H, MLA_LATENT), a["query"].dtype),
                    lse=alloc((B, H), np.float32), query=a["query"], kv_cache=a["kv_cache"],
                    block_table=a["block_table"], seq_lens=a["seq_lens"], scale=a["scale"],
                    num_kv_splits=case.n_splits)

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.testing.arguments import (
            Makers,
            Mutation,
            always,
            huge_pages,
            other_elem,
            zeros_like_shape,
        )
        from kgen.testing.mla import partials_mutations

        m = Makers(self)
        return {
            **super().contract_mutations(),
            # one element type for the queries and the cache (in_dtype)
            "mla_decode_query_elem": Mutation("dtype", always, m.replace_from_args(
                "query", other_elem)),
            "mla_decode_query_width": Mutation("shape", always, m.replace_from_args(
                "query", zeros_like_shape(lambda s: (s[0], s[1], s[2] - 64)))),
            "mla_decode_table_rows": Mutation("shape", always, m.replace_from_args(
                "block_table", zeros_like_shape(lambda s: (s[0] + 1, s[1])))),
            "mla_decode_cache_width": Mutation("shape", always, m.replace_from_args(
                "kv_cache", zeros_like_shape(lambda s: (s[0], s[1], s[2] + 1)))),
            "mla_decode_positions_overflow": Mutation("int32 position", always,
                                                      m.replace_from_args("kv_cache",
                                                                          huge_pages)),
            "mla_decode_scale_not_finite": Mutation("scale", always, m.replace_from_args(
                "scale", lambda x, a: float("inf"))),
            "mla_decode_scale_not_positive": Mutation("scale", always, m.replace_from_args(
                "scale", lambda x, a: 0.0)),
            "mla_decode_seq_len_zero": Mutation("seq_lens", always, m.replace_from_args(
                "seq_lens", lambda x, a: np.zeros_like(x))),
            "mla_decode_seq_past_table": Mutation("block_table", always, m.replace_from_args(
                "seq_lens", lambda x, a: x + 10**6)),
            "mla_decode_block_outside": Mutation("block_table", always, m.replace_from_args(
                "block_table", lambda x, a: x + 10**6)),
            "mla_decode_splits_over_grid": Mutation("grid", always, m.shape_only(
                n_splits=2**16)),
            **partials_mutations(self, "m_out", "l_out", "acc_out"),
        }

    def case_candidates(self, k) -> list:
        from kgen.testing.mla import DECODE

        return DECODE

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        return [Case("mla_smallest", requests=((1, 1),), n_head=1, n_splits=1, block_size=1)]

    def gpu_check(self, k, fn, case, find) -> None:
        from kgen.testing import mla

        return mla.check_decode(k, fn, case)


OP = MlaDecode()
