"""The op ``dense_attention``: the engine's AttentionDenseFast / AttentionDenseFlash: one
sequence, a warp per (query, q head).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from kgen.ir.axes import Op
from kgen.ir.params import INT_MAX
from kgen.ir.signature import elems, fixed
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef, PublicCall
from kgen.ops.dflash_attention import DflashAttention

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker


class DenseAttention(OpDef):
    op = Op.DENSE_ATTENTION

    # --- spec: axes and checks
    in_dtype = True
    out_dtype = True
    own_keys = frozenset({"keys_per_step", "tile_keys", "max_head_dim", "kv_reads"})
    # A warp per (query, q head) as in dflash: the same lane registers hold the same rows.
    check_dflash_registers = DflashAttention.check_dflash_registers

    def check_dense_tile(self, k: Kernel, ctx: Ctx) -> None:
        """A shared_tile block's K and V tiles (tile_keys rows of max_head_dim floats each)
        fit the shared memory a block may use."""
        from kgen.compiler.spec.contract import written_last
        from kgen.ir.geometry import dense_shared_bytes

        need, limit = dense_shared_bytes(k), TARGET.shared_per_block
        if need > limit:
            key = written_last(k, "max_head_dim", "tile_keys")
            raise ctx.error(k.where(key), f"tile_keys = {k.tile_keys} and max_head_dim = "
                            f"{k.max_head_dim}: the K and V tiles need {need} bytes of shared "
                            f"memory; a block may use {limit}")

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        # the engine's Attention(out, query, key, value)
        out = elems(k.out_dtype, "", "out")
        out += elems(k.in_dtype, "const ", "query", "key", "value")
        out += fixed("int", "n_rows", "n_head", "n_head_kv", "head_dim", "block_causal")
        out += fixed("float", "scale")
        return out

    # --- render
    listed = ("kv_reads",)  # kgen list
    def render_flags(self, k) -> frozenset[str]:
        return frozenset({"dflash"})  # the DFlash row helpers

    def sized_head_dim(self, k) -> int | None:
        return k.max_head_dim  # a warp's q and output rows, in registers

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, whatever head_dim; its tiles are static shared memory
        from kgen.ir.geometry import dense_threads

        return dense_threads(), 0

    # --- binding and launch
    entries = ("attention_dense_fast", "attention_dense_flash")  # kgen.runtime's public calls
    public_calls = (PublicCall("attention_dense_fast", writes=("out",)),
                    PublicCall("attention_dense_flash", writes=("out",)))

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        from kgen.runtime.checks import check_dflash_shape

        check_dflash_shape(k, c, hd)

    def bind(self, k: Kernel, c: Checker, a: dict):
        """The engine's Attention over one sequence (AttentionDenseFast, AttentionDenseFlash):
        query [n_rows][n_head][head_dim] and key / value [n_rows][n_head_kv][head_dim] of
        in_dtype, out [n_rows][n_head][head_dim] of out_dtype, every array C-contiguous; a
        warp per (query row, q head), its head_dim within max_head_dim (check_dflash_shape:
        the same warp's registers); the tiles of shared_tile are static shared memory."""
        from kgen.ir.geometry import DENSE_ROWS, dense_grid, dense_threads
        from kgen.runtime.checks import check_dflash_shape, param

        fi, fo = k.in_dtype.fmt, k.out_dtype.fmt
        q = a["query"]
        c.array("query", q, np.dtype(fi.dtype), 3)
        T, H, D = (int(x) for x in q.shape)
        c.require(T >= 1 and H >= 1 and D >= 1, "shape",
                  lambda: f"query has shape {(T, H, D)}: no rows to attend")
        check_dflash_shape(k, c, D)
        c.array("out", a["out"], np.dtype(fo.dtype), 3)
        c.shape("out", a["out"], (T, H, D))
        c.array("key", a["key"], np.dtype(fi.dtype), 3)
        hk = int(a["key"].shape[1])
        c.require(hk >= 1, "shape", lambda: "key has no kv heads")
        c.shape("key", a["key"], (T, hk, D))
        c.array("value", a["value"], np.dtype(fi.dtype), 3)
        c.shape("value", a["value"], (T, hk, D))
        c.require(H % hk == 0, "GQA", lambda: f"n_head = {H} is not a multiple of "
                  f"n_head_kv = {hk}")
        c.require(T * H <= INT_MAX - DENSE_ROWS, "int32 index",
                  lambda: f"{T} rows x {H} heads overflow the kernel's int row index")
        values = dict(out=a["out"], query=q, key=a["key"], value=a["value"], n_rows=T,
                      n_head=H, n_head_kv=hk, head_dim=D,
                      block_causal=param(c, a, "block_causal"),
                      scale=param(c, a, "scale", 1.0 / math.sqrt(D)))
        return dense_grid(T, H, hk), (dense_threads(), 1, 1), 0, values

    # --- C++ view

    # --- contracts, reference and test cases
    mutated_array = "query"

    def contract_args(self, k, case, alloc) -> dict:
        from kgen.testing import dense

        return dense.host_args(k, case, alloc)

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.testing.arguments import Makers, Mutation, ShapeOnly, always, grown

        m = Makers(self)

        def other_dtype(a, c):
            """The same shape in the element type the kernel does not take (f32 <-> bf16)."""
            return np.zeros(a.shape, np.uint16 if a.dtype == np.float32 else np.float32)
        return {
            **super().contract_mutations(),
            "dense_head_dim_over_max": Mutation("head_dim range", always, lambda k, c: m.args(
                k, c.with_(head_dim=k.max_head_dim + 1))),
            "dense_gqa_mismatch": Mutation("GQA", always, m.at(n_head=7, n_head_kv=2)),
            "dense_out_shape": Mutation("shape", always, m.replace_from_case("out", grown(1))),
            "dense_out_rows": Mutation("shape", always, m.replace_from_case("out", grown(0))),
            "dense_key_rows_mismatch": Mutation("shape", always, m.replace_from_case(
                "key", grown(0))),
            "dense_value_heads_mismatch": Mutation("shape", always, m.replace_from_case(
                "value", grown(1))),
            "dense_key_head_dim_mismatch": Mutation("shape", always, m.replace_from_case(
                "key", grown(2))),
            "dense_no_kv_heads": Mutation("shape", always, m.replace_from_case(
                "key", lambda a, c: np.zeros((a.shape[0], 0, a.shape[2]), a.dtype))),
            "dense_query_2d": Mutation("shape", always, m.replace_from_case(
                "query", lambda a, c: a.reshape(a.shape[0], -1))),
            "dense_no_rows": Mutation("shape", always, m.replace_from_case(
                "query", lambda a, c: a[:0].copy())),
            "dense_key_dtype": Mutation("dtype", always, m.replace_from_case(
                "key", other_dtype)),
            "dense_value_dtype": Mutation("dtype", always, m.replace_from_case(
                "value", other_dtype)),
            "dense_out_dtype": Mutation("dtype", always, m.replace_from_case(
                "out", other_dtype)),
            "dense_causal_range": Mutation("range", always, lambda k, c: {
                **m.args(k, c), "block_causal": 2}),
            "dense_scale_not_finite": Mutation("scale", always, lambda k, c: {
                **m.args(k, c), "scale": float("nan")}),
            "dense_scale_not_positive": Mutation("scale", always, lambda k, c: {
                **m.args(k, c), "scale": -1.0}),
            "dense_int32_rows": Mutation("int32 index", always, lambda k, c: m.args(
                k, c.with_(n=2**27, n_head=16, n_head_kv=16, head_dim=1), alloc=ShapeOnly)),
        }

    def mutated_integer(self, k) -> str | None:
        return "block_causal"

    def case_candidates(self, k) -> list:
        from kgen.testing.shapes import DENSE

        return DENSE

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        # one dim a row, GQA, past two tiles, partial blocks
        hd, n = self.case_smallest_head_dim(k), 2 * k.tile_keys + 3
        return [Case(f"hd{hd}_smallest", n=n, n_head=3, n_head_kv=1, head_dim=hd),
                Case(f"hd{hd}_smallest_causal", n=n, n_head=3, n_head_kv=1, head_dim=hd,
                     causal=True),
                Case(f"hd{k.max_head_dim}_widest_causal", n=n, n_head=2, n_head_kv=2,
                     head_dim=k.max_head_dim, causal=True)]

    def gpu_check(self, k, fn, case, find) -> None:
        from kgen.testing import dense

        return dense.check(k, fn, case)

    def gpu_relation(self, kind: str, tolerance: float, ka, fa, kb, fb, case) -> None:
        from kgen.testing import dense

        return dense.relation(kind, tolerance, ka, fa, kb, fb, case)


OP = DenseAttention()
