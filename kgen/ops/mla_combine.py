"""The op ``mla_combine``: MLA decode, merge stage: the splits in ascending order."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kgen.ir.axes import Lse, Op
from kgen.ir.geometry import MLA_COMBINE_THREADS, MLA_LATENT
from kgen.ir.params import INT_MAX
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker


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
    listed = ("lse",)  # kgen list
    def writes_mla_lse(self, k) -> bool:
        return k.lse is Lse.WRITE  # [B][Hq]

    def render_flags(self, k) -> frozenset[str]:
        return frozenset({"mla"})  # the split bounds

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, all its shared memory static
        return self.mla_threads(k), 0

    # --- binding and launch
    entries = ("mla_decode_attention",)  # kgen.runtime's public calls

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        from kgen.runtime.checks import check_mla_shape

        check_mla_shape(k, c, hd, self.mla_width())

    def bind(self, k: Kernel, c: Checker, a: dict):
        """The merge stage of a decode: the (m, l, acc) partials of every split, in
        ascending order, into out [B][Hq][MLA_LATENT] (and lse [B][Hq], lse = write)."""
        from kgen.ir.geometry import MLA_COMBINE_THREADS, MLA_LATENT, mla_combine_grid
        from kgen.runtime.checks import elem, mla_lens, mla_partials

        out = a["out"]
        c.array("out", out, elem(k.out_dtype), 3)
        B, H = (int(n) for n in out.shape[:2])
        c.shape("out", out, (B, H, MLA_LATENT))
        c.require(B >= 1 and H >= 1, "shape", lambda: f"out has shape {tuple(out.shape)}")
        S = mla_partials(c, a, ("m_in", "l_in", "acc_in"), B, H)
        mla_lens(c, a, B)
        values = dict(m_in=a["m_in"], l_in=a["l_in"], acc_in=a["acc_in"], seq_lens=a["seq_lens"],
                      out=out, n_head=H, kv_splits=S)
        if k.lse is Lse.WRITE:
            c.array("lse", a["lse"], np.float32, 2)
            c.shape("lse", a["lse"], (B, H))
            values["lse"] = a["lse"]
        c.require(B * H <= INT_MAX, "int32 index", lambda: f"{B} requests x {H} heads overflow "
                  "the kernel's int row index")
        return mla_combine_grid(B, H), (MLA_COMBINE_THREADS, 1, 1), 0, values

    # --- C++ view
    def cpp_roles(self) -> dict:
        return {f"mla_combine_{lse.value}": self.role(lse=lse.value) for lse in Lse}

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

    def gpu_check(self, k, fn, case, find) -> None:
        from kgen.testing import mla

        return mla.check_combine(k, fn, case)


OP = MlaCombine()
