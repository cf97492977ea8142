"""The op ``kv_append``: write new K/V rows into the cache (host, device, slots or paged
position).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import Op
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel


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

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = KvAppend()
