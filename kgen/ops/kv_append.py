"""The op ``kv_append``: write new K/V rows into the cache (host, device, slots or paged
position).
"""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class KvAppend(OpDef):
    op = Op.KV_APPEND

    # --- spec: axes and checks
    cache = True

    # --- signature and geometry

    # --- render
    def format_uses(self, k) -> dict[str, set[str]]:
        return {k.fmt.name: {"quant"}, k.v_fmt.name: {"quant"}}  # the append quantizer

    def sized_head_dim(self, k) -> int | None:
        return k.max_head_dim if k.pair.append_staging else None  # its static staging

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = KvAppend()
