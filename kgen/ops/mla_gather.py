"""The op ``gather_mla_cache``: MLA: the engine's GatherMlaCache, requests' cache rows into a
contiguous workspace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kgen.ir.axes import Op, SeqStarts
from kgen.ir.geometry import mla_gather_threads
from kgen.ir.params import INT_MAX
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef

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
        out = elems(k.in_dtype, "", "dst") + elems(k.in_dtype, "const ", "src_cache")
        out += fixed("const int *", "block_table", "cu_seq_lens", "token_to_seq")
        if k.seq_starts is SeqStarts.GIVEN:
            out += fixed("const int *", "seq_starts")
        out += fixed("int", "num_tokens", "num_reqs", "num_blocks", "block_size", "max_blocks")
        return out

    def mla_threads(self, k: Kernel) -> int:
        return mla_gather_threads()

    # --- render
    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, all its shared memory static
        return self.mla_threads(k), 0

    # --- binding and launch
    entries = ("gather_mla_cache",)  # kgen.runtime's public calls

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        from kgen.runtime.checks import check_mla_shape

        check_mla_shape(k, c, hd, self.mla_width())

    def bind(self, k: Kernel, c: Checker, a: dict):
        """Requests' latent rows (from seq_starts[r] on, if given) into the contiguous
        workspace dst [N][MLA_ROW], laid out by cu_seq_lens; token_to_seq names each
        row's request."""
        from kgen.ir.geometry import MLA_ROW, mla_gather_grid, mla_gather_threads
        from kgen.runtime.checks import (
            aligned,
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
        aligned(c, "dst", dst)
        nb, bs = latent_pages(k, c, "src_cache", a["src_cache"])
        aligned(c, "src_cache", a["src_cache"])
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


OP = MlaGather()
