"""The op ``dflash_attention``: the engine's DFlash block attention: each query attends only
its request's block (and, paged, its context).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Op
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel


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

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = DflashAttention()
