"""The op ``dense_attention``: the engine's AttentionDenseFast / AttentionDenseFlash: one
sequence, a warp per (query, q head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Op
from kgen.ir.signature import elems, fixed
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef
from kgen.ops.dflash_attention import DflashAttention

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


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

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = DenseAttention()
