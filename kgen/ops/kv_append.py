"""The op ``kv_append``: write new K/V rows into the cache (host, device, slots or paged
position).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Op, Position
from kgen.ir.signature import cache_arrays, fixed, position_params
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class KvAppend(OpDef):
    op = Op.KV_APPEND

    # --- spec: axes and checks
    cache = True
    own_keys = frozenset({"position", "max_head_dim"})

    def check_limits(self, k: Kernel, ctx: Ctx) -> None:
        """Append staging holds a row of at least one format block and at most a block's
        threads."""
        from kgen.compiler.spec.contract import kv_said

        fmt, hd = k.pair, k.max_head_dim
        if hd > TARGET.max_threads:
            raise ctx.error(k.where("max_head_dim"), f"max_head_dim = {hd}: an append block "
                            f"is head_dim threads, at most {TARGET.max_threads}")
        if fmt.append_staging and hd < fmt.block:
            raise ctx.error(k.where("max_head_dim"), f"max_head_dim = {hd} admits no "
                            f"head_dim: a {kv_said(k)} row is whole blocks of {fmt.block} "
                            f"values (max_head_dim >= {fmt.block})")

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        fmt = k.pair  # the cache's formats: shadows and scales of the roles that keep them
        shadows = [s.name for s in fmt.shadow_buffers()]
        shadow_scalars = list(fmt.shadow_scalars())
        scales = list(fmt.scale_scalars())
        out = fixed("const float *", "k_new", "v_new")
        out += cache_arrays(k, "")
        out += fixed("__half *", *shadows)
        if k.position is Position.PAGED:  # reshape_and_cache
            out += fixed("const int *", "slot_mapping") + fixed("int", "n_head_kv", "head_dim")
        else:
            out += fixed("int", "n_head_kv", "head_dim", "max_seq")
            out += position_params(k, fixed("int", "pos0"))
        out += fixed("int", *shadow_scalars)
        out += fixed("float", *scales)
        return out

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = KvAppend()
