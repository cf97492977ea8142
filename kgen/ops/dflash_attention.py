"""The op ``dflash_attention``: the engine's DFlash block attention: each query attends only
its request's block (and, paged, its context).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import KeySource, Op
from kgen.ir.signature import elems, fixed
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


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

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = DflashAttention()
