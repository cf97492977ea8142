"""The op ``dflash_attention``: the engine's DFlash block attention: each query attends only
its request's block (and, paged, its context).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from kgen.ir.axes import KeySource, Op
from kgen.ir.params import INT_MAX
from kgen.ir.signature import elems, fixed
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef, PublicCall

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker


class DflashAttention(OpDef):
    op = Op.DFLASH_ATTENTION

    # --- spec: axes and checks
    in_dtype = True
    out_dtype = True
    own_keys = frozenset({"keys_per_step", "max_head_dim", "key_source"})

    def check_dflash_registers(self, k: Kernel, ctx: Ctx) -> None:
        """A lane's q and output dims and the K and V dims of its keys in flight fit a
        thread's registers."""
        from kgen.compiler.spec.contract import written_last
        from kgen.ir.geometry import dflash_chunks, dflash_held_floats

        held, limit = dflash_held_floats(k), TARGET.registers_per_thread
        if held > limit:
            key = written_last(k, "max_head_dim", "keys_per_step")
            raise ctx.error(k.where(key), f"max_head_dim = {k.max_head_dim} and keys_per_step = "
                            f"{k.keys_per_step}: a lane holds {dflash_chunks(k)} dims of q, of "
                            f"the output and of the K and V of each key in flight ({held} "
                            f"floats); a {TARGET.arch} thread has {limit} registers")

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:  # the engine's argument order and names
        paged = k.key_source is KeySource.PAGED
        out = elems(k.out_dtype, "", "out") + elems(k.in_dtype, "const ", "query")
        out += elems(k.in_dtype, "const ", *(("block_key", "block_value", "ctx_key",
                                              "ctx_value") if paged else ("key", "value")))
        out += fixed("const int *", "cu_seqlens", *(("seq_lens", "block_table") if paged else ()))
        out += fixed("int", "n_rows", "n_head", "n_head_kv", "head_dim", "num_reqs")
        if paged:
            out += fixed("int", "block_size", "max_blocks", "num_pages")
        out += fixed("int", "block_causal", "sliding_window") + fixed("float", "scale")
        return out

    # --- render
    listed = ("key_source",)  # kgen list
    def render_flags(self, k) -> frozenset[str]:
        return frozenset({"dflash"})

    def sized_head_dim(self, k) -> int | None:
        return k.max_head_dim  # a warp's q and output rows, in registers

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, whatever head_dim
        from kgen.ir.geometry import dflash_threads

        return dflash_threads(), 0

    # --- binding and launch
    entries = (  # kgen.runtime's public calls
        "dflash_block_attention",
        "dflash_paged_block_attention",
    )
    public_calls = (PublicCall("dflash_block_attention", writes=("out",)),
                    PublicCall("dflash_paged_block_attention", writes=("out",)))

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        from kgen.runtime.checks import check_dflash_shape

        check_dflash_shape(k, c, hd)

    def bind(self, k: Kernel, c: Checker, a: dict):
        """The engine's DFlash block attention. query and out are [n_rows][n_head][head_dim];
        dense: key / value [n_rows][n_head_kv][head_dim]; paged: block_key / block_value
        alike, ctx_key / ctx_value pages [num_pages][block_size][n_head_kv][head_dim]; out
        of the kernel's out_dtype, query and every key / value array of its in_dtype;
        seq_lens [num_reqs] and block_table [num_reqs][max_blocks] int32. cu_seqlens
        [num_reqs + 1] int32. Every array C-contiguous. The index tensors are read in place
        by the kernel (never by the host: the launch can be captured), which writes zeros
        to rows outside every request and NaN to rows of a request whose entries break the
        contract (kgen.runtime.dflash checks them on the host first, unless told not to)."""
        from kgen.ir.geometry import DFLASH_ROWS, dflash_grid, dflash_threads
        from kgen.runtime.checks import check_dflash_shape, elem, index, param

        paged = k.key_source is KeySource.PAGED
        fi, fo = elem(k.in_dtype), elem(k.out_dtype)
        q = a["query"]
        c.array("query", q, fi, 3)
        T, H, D = (int(x) for x in q.shape)
        c.require(T >= 1 and H >= 1 and D >= 1, "shape",
                  lambda: f"query has shape {(T, H, D)}: no rows to attend")
        check_dflash_shape(k, c, D)
        c.array("out", a["out"], fo, 3)
        c.shape("out", a["out"], (T, H, D))
        kn, vn = ("block_key", "block_value") if paged else ("key", "value")
        c.array(kn, a[kn], fi, 3)
        hk = int(a[kn].shape[1])
        c.require(hk >= 1, "shape", lambda: f"{kn} has no kv heads")
        c.shape(kn, a[kn], (T, hk, D))
        c.array(vn, a[vn], fi, 3)
        c.shape(vn, a[vn], (T, hk, D))
        c.require(H % hk == 0, "GQA", lambda: f"n_head = {H} is not a multiple of "
                  f"n_head_kv = {hk}")
        cu = a["cu_seqlens"]
        c.array("cu_seqlens", cu, np.int32, 1)
        reqs = int(cu.shape[0]) - 1
        c.require(reqs >= 1, "shape", "cu_seqlens needs num_reqs + 1 entries")
        c.require(T * H <= INT_MAX - DFLASH_ROWS, "int32 index",
                  lambda: f"{T} rows x {H} heads overflow the kernel's int row index")
        values = dict(out=a["out"], query=q, cu_seqlens=cu, n_rows=T, n_head=H, n_head_kv=hk,
                      head_dim=D, num_reqs=reqs)
        values[kn], values[vn] = a[kn], a[vn]
        if paged:
            ck, cv = a["ctx_key"], a["ctx_value"]
            c.array("ctx_key", ck, fi, 4)
            c.array("ctx_value", cv, fi, 4)
            nb, bs = int(ck.shape[0]), int(ck.shape[1])
            c.shape("ctx_key", ck, (nb, bs, hk, D))
            c.shape("ctx_value", cv, (nb, bs, hk, D))
            c.require(nb >= 1 and bs >= 1, "shape", "empty context pages")
            c.require(nb * bs <= INT_MAX, "int32 position", lambda: f"{nb} pages of {bs} "
                      "positions overflow an int position")
            index(c, a, "seq_lens", (reqs,))
            bt = a["block_table"]
            c.array("block_table", bt, np.int32, 2)
            c.require(int(bt.shape[0]) == reqs, "shape", lambda: f"block_table has "
                      f"{bt.shape[0]} rows for {reqs} requests")
            mb = int(bt.shape[1])
            c.require(mb >= 1, "shape", "block_table has no columns")
            c.require(mb * bs + T + k.keys_per_step <= INT_MAX, "int32 position",
                      lambda: f"{mb} blocks of {bs} context positions and {T} block rows "
                      f"(and a step of {k.keys_per_step} keys) overflow an int position")
            values.update(ctx_key=ck, ctx_value=cv, seq_lens=a["seq_lens"], block_table=bt,
                          block_size=bs, max_blocks=mb, num_pages=nb)
        values.update(block_causal=param(c, a, "block_causal"),
                      sliding_window=param(c, a, "sliding_window"),
                      scale=param(c, a, "scale", 1.0 / math.sqrt(D)))
        return dflash_grid(T, H), (dflash_threads(), 1, 1), 0, values

    # --- C++ view
    def cpp_view(self, k, hd, groups, rows) -> dict:
        # the paged context then the block (key_source = paged)
        return super().cpp_view(k, hd, groups, rows) | {
            "paged_keys": k.key_source is KeySource.PAGED}

    def cpp_roles(self) -> dict:
        return {f"dflash_{src.value}": self.role(key_source=src.value) for src in KeySource}

    # --- contracts, reference and test cases
    mutated_array = "query"

    def contract_args(self, k, case, alloc) -> dict:
        from kgen.testing import dflash

        return dflash.host_args(k, case, alloc)

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.ir.params import INT_MAX
        from kgen.testing.arguments import (
            Makers,
            Mutation,
            ShapeOnly,
            always,
            grown,
            other_elem,
        )
        from kgen.testing.dflash import paged

        m = Makers(self)

        def keys(k) -> tuple[str, str]:
            """The names of the block's key and value rows."""
            return ("block_key", "block_value") if paged(k) else ("key", "value")
        return {
            **super().contract_mutations(),
            "dflash_head_dim_over_max": Mutation("head_dim range", always, lambda k, c: m.args(
                k, c.with_(head_dim=k.max_head_dim + 1))),
            "dflash_gqa_mismatch": Mutation("GQA", always, m.at(n_head=7, n_head_kv=2)),
            "dflash_out_shape": Mutation("shape", always, m.replace_from_case(
                "out", grown(1))),
            "dflash_key_rows_mismatch": Mutation("shape", always, m.replace_from_case(
                lambda k: keys(k)[0], grown(0))),
            "dflash_value_heads_mismatch": Mutation("shape", always, m.replace_from_case(
                lambda k: keys(k)[1], grown(1))),
            "dflash_key_head_dim_mismatch": Mutation("shape", always, m.replace_from_case(
                lambda k: keys(k)[0], grown(2))),
            # one element type for query and every key / value array (in_dtype), out's own
            "dflash_key_elem": Mutation("dtype", always, m.replace_from_case(
                lambda k: keys(k)[0], other_elem)),
            "dflash_value_elem": Mutation("dtype", always, m.replace_from_case(
                lambda k: keys(k)[1], other_elem)),
            "dflash_query_elem": Mutation("dtype", always, m.replace_from_case(
                "query", other_elem)),
            "dflash_out_elem": Mutation("dtype", always, m.replace_from_case("out", other_elem)),
            "dflash_ctx_value_elem": Mutation("dtype", paged, m.replace_from_case(
                "ctx_value", other_elem)),
            "dflash_cu_seqlens_dtype": Mutation("dtype", always, m.replace_from_case(
                "cu_seqlens", lambda a, c: a.astype(np.int64))),
            "dflash_cu_seqlens_2d": Mutation("shape", always, m.replace_from_case(
                "cu_seqlens", lambda a, c: a.reshape(1, -1))),
            "dflash_no_requests": Mutation("shape", always, m.replace_from_case(
                "cu_seqlens", lambda a, c: a[:1].copy())),
            "dflash_causal_range": Mutation("range", always, lambda k, c: {
                **m.args(k, c), "block_causal": 2}),
            "dflash_window_over_int": Mutation("range", always, lambda k, c: {
                **m.args(k, c), "sliding_window": INT_MAX + 1}),
            "dflash_scale_not_finite": Mutation("scale", always, lambda k, c: {
                **m.args(k, c), "scale": float("inf")}),
            "dflash_scale_not_positive": Mutation("scale", always, lambda k, c: {
                **m.args(k, c), "scale": 0.0}),
            "dflash_int32_rows": Mutation("int32 index", always, lambda k, c: m.args(
                k, c.with_(requests=((2**27, 0),), n_head=16, n_head_kv=16, head_dim=1),
                alloc=ShapeOnly)),
            "dflash_ctx_pages_mismatch": Mutation("shape", paged, m.replace_from_case(
                "ctx_value", grown(1))),
            "dflash_ctx_heads_mismatch": Mutation("shape", paged, m.replace_from_case(
                "ctx_key", grown(2))),
            "dflash_seq_lens_size": Mutation("shape", paged, m.replace_from_case(
                "seq_lens", grown(0))),
            "dflash_block_table_rows": Mutation("shape", paged, m.replace_from_case(
                "block_table", grown(0))),
            "dflash_block_table_no_columns": Mutation("shape", paged, m.replace_from_case(
                "block_table", lambda a, c: np.zeros((a.shape[0], 0), a.dtype))),
            "dflash_block_table_dtype": Mutation("dtype", paged, m.replace_from_case(
                "block_table", lambda a, c: a.astype(np.int64))),
            "dflash_pages_int32_position": Mutation("int32 position", paged, lambda k, c: {
                **m.args(k, c), **{n: ShapeOnly((2**20, 2**12, c.n_head_kv, c.head_dim),
                                               np.dtype(k.in_dtype.fmt.dtype))
                                   for n in ("ctx_key", "ctx_value")}}),
            "dflash_table_int32_position": Mutation("int32 position", paged, m.replace_from_case(
                "block_table", lambda a, c: ShapeOnly((a.shape[0], 2**31 // c.block_size),
                                                      a.dtype))),
        }

    def mutated_integer(self, k) -> str | None:
        return "sliding_window"

    def case_candidates(self, k) -> list:
        from kgen.ir.axes import KeySource
        from kgen.testing.shapes import DFLASH_DENSE, DFLASH_PAGED

        return DFLASH_PAGED if k.key_source is KeySource.PAGED else DFLASH_DENSE

    def case_required(self, k) -> list:
        from kgen.ir.axes import KeySource
        from kgen.testing.case import Case

        # one dim a row, GQA, a partial block of warps
        hd = self.case_smallest_head_dim(k)
        ctx = 3 if k.key_source is KeySource.PAGED else 0
        return [Case(f"hd{hd}_smallest", requests=((3, ctx), (2, ctx + 2)), n_head=3,
                     n_head_kv=1, head_dim=hd, block_size=2),
                Case(f"hd{hd}_smallest_causal", requests=((3, ctx), (2, ctx + 2)), n_head=3,
                     n_head_kv=1, head_dim=hd, block_size=2, causal=True),
                Case(f"hd{k.max_head_dim}_widest_causal_win2", requests=((5, ctx),), n_head=2,
                     n_head_kv=2, head_dim=k.max_head_dim, block_size=2, causal=True,
                     sliding_window=2)]

    def gpu_check(self, k, fn, case, find) -> None:
        from kgen.testing import dflash

        return dflash.check(k, fn, case, find)


OP = DflashAttention()
