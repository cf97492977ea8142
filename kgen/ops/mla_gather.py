"""The op ``gather_mla_cache``: MLA: the engine's GatherMlaCache, requests' cache rows into a
contiguous workspace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kgen.ir.axes import Op, SeqStarts
from kgen.ir.geometry import MLA_GATHER_QUAD, mla_gather_threads
from kgen.ir.params import INT_MAX
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef, PublicCall

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker


class MlaGather(OpDef):
    op = Op.MLA_GATHER

    # --- spec: axes and checks
    mla = True
    in_dtype = True
    own_keys = frozenset({"seq_starts"})

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:  # the engine's GatherMlaCache
        # rows copied a float4 at a time
        out = elems(k.in_dtype, "", "dst", align=MLA_GATHER_QUAD)
        out += elems(k.in_dtype, "const ", "src_cache", align=MLA_GATHER_QUAD)
        out += fixed("const int *", "block_table", "cu_seq_lens", "token_to_seq")
        if k.seq_starts is SeqStarts.GIVEN:
            out += fixed("const int *", "seq_starts")
        out += fixed("int", "num_tokens", "num_reqs", "num_blocks", "block_size", "max_blocks")
        return out

    def mla_threads(self, k: Kernel) -> int:
        return mla_gather_threads()

    # --- render
    listed = ("seq_starts",)  # kgen list
    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, all its shared memory static
        return self.mla_threads(k), 0

    # --- binding and launch
    entries = ("gather_mla_cache",)  # kgen.runtime's public calls
    public_calls = (PublicCall("gather_mla_cache", writes=("dst",), optional=("seq_starts",)),)

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        from kgen.runtime.checks import check_mla_shape

        check_mla_shape(k, c, hd, self.mla_width())

    def bind(self, k: Kernel, c: Checker, a: dict):
        """Requests' latent rows (from seq_starts[r] on, if given) into the contiguous
        workspace dst [N][MLA_ROW], laid out by cu_seq_lens; token_to_seq names each
        row's request."""
        from kgen.ir.geometry import MLA_ROW, mla_gather_grid, mla_gather_threads
        from kgen.runtime.checks import (
            elem,
            host_ints,
            index,
            latent_pages,
            mla_tables,
            mla_used_blocks,
        )

        dst = a["dst"]
        c.array("dst", dst, elem(k.in_dtype), 2)
        rows = int(dst.shape[0])
        c.shape("dst", dst, (rows, MLA_ROW))
        nb, bs = latent_pages(k, c, "src_cache", a["src_cache"])
        reqs, mb = mla_tables(c, a, None)
        index(c, a, "cu_seq_lens", (reqs + 1,))
        t2s = a["token_to_seq"]
        c.array("token_to_seq", t2s, np.int32, 1)
        given = k.seq_starts is SeqStarts.GIVEN
        if given:
            index(c, a, "seq_starts", (reqs,))
        n = c.integer("num_tokens", a["num_tokens"], 1, INT_MAX - 32)
        c.require(n <= rows, "shape", lambda: f"num_tokens = {n}: dst holds {rows} rows")
        c.require(n <= int(t2s.shape[0]), "shape", lambda: f"num_tokens = {n}: token_to_seq "
                  f"holds {int(t2s.shape[0])} entries")
        if a.get("validate_pos", True):
            cu = host_ints(a["cu_seq_lens"]).astype(np.int64)
            c.require(int(cu[0]) == 0 and bool((np.diff(cu) >= 0).all()), "cu_seq_lens",
                      "cu_seq_lens must rise from 0")
            seqs = host_ints(t2s)[:n].astype(np.int64)
            at = np.arange(n)
            ok = (seqs >= 0) & (seqs < reqs)
            ok[ok] &= (cu[seqs[ok]] <= at[ok]) & (at[ok] < cu[seqs[ok] + 1])
            c.require(bool(ok.all()), "token_to_seq", lambda: f"token {int(np.argmin(ok))} is "
                      "not a row of the request token_to_seq names (cu_seq_lens)")
            starts = host_ints(a["seq_starts"]).astype(np.int64) if given else \
                np.zeros(reqs, np.int64)
            c.require(bool((starts >= 0).all() and (starts % bs == 0).all()), "seq_starts",
                      lambda: f"seq_starts must be >= 0 and multiples of block_size = {bs}")
            table = host_ints(a["block_table"])
            for r in sorted(set(seqs.tolist())):
                last = min(int(cu[r + 1]), n)
                mla_used_blocks(c, table, r, int(starts[r]), int(starts[r]) + last - int(cu[r]),
                                nb, bs)
        values = dict(dst=dst, src_cache=a["src_cache"], block_table=a["block_table"],
                      cu_seq_lens=a["cu_seq_lens"], token_to_seq=t2s, num_tokens=n,
                      num_reqs=reqs, num_blocks=nb, block_size=bs, max_blocks=mb)
        if given:
            values["seq_starts"] = a["seq_starts"]
        return mla_gather_grid(n), (mla_gather_threads(), 1, 1), 0, values

    # --- C++ view
    def cpp_roles(self) -> dict:
        return {f"mla_gather_{s.value}": self.role(seq_starts=s.value)
                for s in SeqStarts}

    # --- contracts, reference and test cases
    mutated_array = "dst"

    def contract_args(self, k, case, alloc) -> dict:
        from kgen.ir.axes import SeqStarts
        from kgen.ir.geometry import MLA_ROW
        from kgen.testing.mla import elems, gather_layout, layout

        z, (ei, _) = alloc, elems(k)
        lay = layout(case)
        pages = z((lay["num_blocks"], case.block_size, MLA_ROW), ei)
        gl = gather_layout(case)
        a = dict(dst=z((gl["num_tokens"], MLA_ROW), ei), src_cache=pages,
                 block_table=lay["block_table"], cu_seq_lens=gl["cu_seq_lens"],
                 token_to_seq=gl["token_to_seq"], num_tokens=gl["num_tokens"])
        if k.seq_starts is SeqStarts.GIVEN:
            a["seq_starts"] = gl["seq_starts"]
        return a

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.ir.axes import SeqStarts
        from kgen.testing.arguments import (
            Makers,
            Mutation,
            always,
            other_elem,
            zeros_like_shape,
        )

        m = Makers(self)

        def given(k) -> bool:
            return k.seq_starts is SeqStarts.GIVEN
        return {
            **super().contract_mutations(),
            # one element type for the workspace and the cache (in_dtype)
            "mla_gather_dst_elem": Mutation("dtype", always, m.replace_from_args(
                "dst", other_elem)),
            "mla_gather_tokens_over_dst": Mutation("shape", always, m.replace_from_args(
                "num_tokens", lambda x, a: x + 1)),
            "mla_gather_tokens_over_map": Mutation("shape", always, m.replace_from_args(
                "token_to_seq", lambda x, a: x[:-1].copy())),
            "mla_gather_no_tokens": Mutation("range", always, m.replace_from_args(
                "num_tokens", lambda x, a: 0)),
            "mla_gather_cu_size": Mutation("shape", always, m.replace_from_args(
                "cu_seq_lens", lambda x, a: x[:-1].copy())),
            "mla_gather_dst_width": Mutation("shape", always, m.replace_from_args(
                "dst", zeros_like_shape(lambda s: (s[0], s[1] + 1)))),
            "mla_gather_src_rank": Mutation("shape", always, m.replace_from_args(
                "src_cache", zeros_like_shape(lambda s: (s[0], s[1], 1, s[2])))),
            "mla_gather_table_int64": Mutation("dtype", always, m.replace_from_args(
                "block_table", lambda x, a: x.astype(np.int64))),
            "mla_gather_starts_size": Mutation("shape", given, m.replace_from_args(
                "seq_starts", lambda x, a: np.zeros(x.size + 1, x.dtype))),
            "mla_gather_start_not_block": Mutation("seq_starts", given, m.replace_from_args(
                "seq_starts", lambda x, a: x + 1, requests=((2, 9),), block_size=4)),
            "mla_gather_token_wrong_seq": Mutation("token_to_seq", always, m.replace_from_args(
                "token_to_seq", lambda x, a: x[::-1].copy(), requests=((2, 2), (1, 1)))),
            "mla_gather_cu_not_rising": Mutation("cu_seq_lens", always, m.replace_from_args(
                "cu_seq_lens", lambda x, a: x + 1)),
            "mla_gather_block_outside": Mutation("block_table", always, m.replace_from_args(
                "block_table", lambda x, a: x + 10**6)),
            "mla_gather_row_past_table": Mutation("block_table", always, m.replace_from_args(
                "block_table", lambda x, a: x[:, :1].copy(), requests=((3, 3),),
                block_size=2)),
        }

    def mutated_integer(self, k) -> str | None:
        return "num_tokens"

    def case_candidates(self, k) -> list:
        from kgen.ir.axes import SeqStarts
        from kgen.testing.mla import GATHER, GATHER_STARTS

        return GATHER_STARTS + GATHER if k.seq_starts is SeqStarts.GIVEN else GATHER

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        return [Case("mla_smallest", requests=((1, 1),), block_size=1)]  # the smallest launch

    def gpu_check(self, k, fn, case, find) -> None:
        from kgen.testing import mla

        return mla.check_gather(k, fn, case)


OP = MlaGather()
