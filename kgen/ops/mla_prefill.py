"""The op ``mla_prefill``: MLA prefill: the engine's MlaPrefillAttention, varlen attention, QK
192, V 128.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from kgen.ir.axes import Lse, Mask, Op
from kgen.ir.geometry import MLA_PREFILL_QK, MLA_PREFILL_ROWS
from kgen.ir.params import INT_MAX
from kgen.ir.pyapi import PyArg
from kgen.ir.signature import elems, fixed
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef, PublicCall

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker


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
        out = elems(k.in_dtype, "const ", "query")
        # K and V rows staged a quad a load (the format's load_quad)
        out += elems(k.in_dtype, "const ", "key", "value", align=k.in_dtype.fmt.quad_bytes)
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
    listed = ("mask", "lse")  # kgen list
    def writes_mla_lse(self, k) -> bool:
        return k.lse is Lse.WRITE  # [H][total_q]

    def mla_causal(self, k) -> bool:
        return k.mask is Mask.CAUSAL  # query i sees keys j <= i + Lk - Lq

    def template_parts(self, k) -> tuple[str, ...]:
        return ("kernels/mla_parts.j2",)

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, all its shared memory static
        return self.mla_threads(k), 0

    # --- binding and launch
    entries = ("mla_prefill_attention",)  # kgen.runtime's public calls
    public_calls = (PublicCall("mla_prefill_attention", writes=("out", "lse"),
                               optional=("lse",)),)

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        from kgen.runtime.checks import check_mla_shape

        check_mla_shape(k, c, hd, self.mla_width())

    def bind(self, k: Kernel, c: Checker, a: dict):
        """Varlen attention, QK head size MLA_PREFILL_QK and V head size MLA_PREFILL_V over
        contiguous K/V: request r owns query rows [cu_seqlens_q[r], cu_seqlens_q[r + 1])
        and key rows likewise; out [total_q][H][MLA_PREFILL_V] (and lse [H][total_q])."""
        from kgen.ir.geometry import (
            MLA_PREFILL_QK,
            MLA_PREFILL_ROWS,
            MLA_PREFILL_V,
            mla_prefill_grid,
        )
        from kgen.runtime.checks import block_registers, elem, host_ints, index, param

        q = a["query"]
        fi = elem(k.in_dtype)
        c.array("query", q, fi, 3)
        Tq, H = (int(n) for n in q.shape[:2])
        c.shape("query", q, (Tq, H, MLA_PREFILL_QK))
        key, value = a["key"], a["value"]
        c.array("key", key, fi, 3)
        Tk = int(key.shape[0])
        c.shape("key", key, (Tk, H, MLA_PREFILL_QK))
        c.array("value", value, fi, 3)
        c.shape("value", value, (Tk, H, MLA_PREFILL_V))
        c.require(Tq >= 1 and H >= 1, "shape", lambda: f"query has shape {tuple(q.shape)}")
        cu_q = a["cu_seqlens_q"]
        c.array("cu_seqlens_q", cu_q, np.int32, 1)
        reqs = int(cu_q.shape[0]) - 1
        c.require(reqs >= 1, "shape", "cu_seqlens_q needs num_reqs + 1 entries")
        index(c, a, "cu_seqlens_k", (reqs + 1,))
        c.array("out", a["out"], elem(k.out_dtype), 3)
        c.shape("out", a["out"], (Tq, H, MLA_PREFILL_V))
        values = dict(query=q, key=key, value=value, cu_seqlens_q=cu_q,
                      cu_seqlens_k=a["cu_seqlens_k"], out=a["out"], n_head=H, num_reqs=reqs,
                      total_q=Tq, scale=param(c, a, "scale", 1.0 / math.sqrt(MLA_PREFILL_QK)))
        if k.lse is Lse.WRITE:
            c.array("lse", a["lse"], np.float32, 2)
            c.require(tuple(a["lse"].shape) == (H, Tq), "lse layout", lambda: f"lse has shape "
                      f"{tuple(a['lse'].shape)}; the LSE layout is [n_head][total_q] = {(H, Tq)}")
            values["lse"] = a["lse"]
        c.require(H * max(Tq, Tk) <= INT_MAX, "int32 index", lambda: f"{max(Tq, Tk)} rows x {H} "
                  "heads overflow the kernel's int row index")
        mq = c.integer("max_seqlen_q", a["max_seqlen_q"], 1, Tq, "max_seqlen_q")
        if a.get("validate_pos", True):
            for name, total in (("cu_seqlens_q", Tq), ("cu_seqlens_k", Tk)):
                cu = host_ints(a[name]).astype(np.int64)
                c.require(int(cu[0]) == 0 and int(cu[-1]) <= total and
                          bool((np.diff(cu) >= 0).all()), name,
                          lambda name=name, total=total: f"{name} must rise from 0 to at most "
                          f"the {total} rows")
            lens = np.diff(host_ints(cu_q).astype(np.int64))
            c.require(int(lens.max()) <= mq, "max_seqlen_q", lambda: f"a request has "
                      f"{int(lens.max())} query rows, above max_seqlen_q = {mq}")
        block_registers(k, c, MLA_PREFILL_ROWS * TARGET.warp, None)
        return mla_prefill_grid(mq, H, reqs), (MLA_PREFILL_ROWS * TARGET.warp, 1, 1), 0, values

    # --- C++ view
    def cpp_roles(self) -> dict:
        return {f"mla_prefill_{m.value}_{lse.value}": self.role(mask=m.value,
                                                               lse=lse.value)
                for lse in Lse for m in Mask}

    # --- contracts, reference and test cases
    mutated_array = "query"

    def contract_args(self, k, case, alloc) -> dict:
        import math

        import numpy as np

        from kgen.ir.axes import Lse
        from kgen.ir.geometry import MLA_PREFILL_QK, MLA_PREFILL_V
        from kgen.testing.mla import elems, prefill_layout

        z, (ei, eo) = alloc, elems(k)
        lay = prefill_layout(case)
        Tq, Tk = int(lay["cu_seqlens_q"][-1]), int(lay["cu_seqlens_k"][-1])
        H = case.n_head
        a = dict(query=z((Tq, H, MLA_PREFILL_QK), ei), key=z((Tk, H, MLA_PREFILL_QK), ei),
                 value=z((Tk, H, MLA_PREFILL_V), ei), cu_seqlens_q=lay["cu_seqlens_q"],
                 cu_seqlens_k=lay["cu_seqlens_k"], out=z((Tq, H, MLA_PREFILL_V), eo),
                 max_seqlen_q=lay["max_seqlen_q"], scale=1.0 / math.sqrt(MLA_PREFILL_QK))
        if k.lse is Lse.WRITE:
            a["lse"] = z((H, Tq), np.float32)
        return a

    def call_args(self, call: str, k, case, alloc) -> dict | None:
        """mla_prefill_attention over the kernel's case: its contract arguments, with its
        mask as the call's ``causal`` and no lse where it writes none."""
        return {"lse": None, **self.contract_args(k, case, alloc),
                "causal": k.mask is Mask.CAUSAL}

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

        m = Makers(self)
        return {
            **super().contract_mutations(),
            # q, K and V of in_dtype, out of out_dtype
            "mla_prefill_value_elem": Mutation("dtype", always, m.replace_from_args(
                "value", other_elem)),
            "mla_prefill_out_elem": Mutation("dtype", always, m.replace_from_args(
                "out", other_elem)),
            "mla_prefill_key_width": Mutation("shape", always, m.replace_from_args(
                "key", zeros_like_shape(lambda s: (s[0], s[1], s[2] - 64)))),
            "mla_prefill_value_rows": Mutation("shape", always, m.replace_from_args(
                "value", zeros_like_shape(lambda s: (s[0] + 1, s[1], s[2])))),
            "mla_prefill_heads_mismatch": Mutation("shape", always, m.replace_from_args(
                "key", zeros_like_shape(lambda s: (s[0], s[1] + 1, s[2])))),
            "mla_prefill_out_width": Mutation("shape", always, m.replace_from_args(
                "out", zeros_like_shape(lambda s: (s[0], s[1], s[2] + 64)))),
            "mla_prefill_cu_k_size": Mutation("shape", always, m.replace_from_args(
                "cu_seqlens_k", lambda x, a: np.zeros(x.size + 1, x.dtype))),
            "mla_prefill_lse_transposed": Mutation(
                "lse layout", lambda k: k.lse is Lse.WRITE,
                m.replace_from_args("lse", zeros_like_shape(lambda s: s[::-1]),
                                    requests=((5, 5),), n_head=3)),
            "mla_prefill_max_seqlen_q_over_rows": Mutation(
                "max_seqlen_q", always, m.replace_from_args(
                    "max_seqlen_q", lambda x, a: int(a["query"].shape[0]) + 1)),
            "mla_prefill_max_seqlen_q_short": Mutation(
                "max_seqlen_q", always, m.replace_from_args(
                    "max_seqlen_q", lambda x, a: x - 1, requests=((1, 1), (3, 3)))),
            "mla_prefill_cu_q_not_rising": Mutation(
                "cu_seqlens_q", always, m.replace_from_args(
                    "cu_seqlens_q", lambda x, a: x[::-1].copy(), requests=((1, 1), (3, 3)))),
            "mla_prefill_cu_k_past_rows": Mutation("cu_seqlens_k", always, m.replace_from_args(
                "cu_seqlens_k", lambda x, a: x * 2)),
            "mla_prefill_rows_over_int": Mutation("int32 index", always, m.shape_only(
                requests=((2**16, 2**16),), n_head=2**15 + 1)),
            "mla_prefill_scale_not_finite": Mutation("scale", always, m.replace_from_args(
                "scale", lambda x, a: float("nan"))),
        }

    def case_candidates(self, k) -> list:
        from kgen.testing.mla import PREFILL

        return PREFILL

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        return [Case("mla_smallest", requests=((1, 1),), n_head=1)]  # the smallest launch

    def gpu_check(self, k, fn, case, find) -> None:
        from kgen.testing import mla

        return mla.check_prefill(k, fn, case)


OP = MlaPrefill()
