"""The op ``kv_append``: write new K/V rows into the cache (host, device, slots or paged
position).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kgen.ir.axes import Op, Position
from kgen.ir.params import INT_MAX
from kgen.ir.signature import cache_arrays, fixed, position_params
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker


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
    def format_uses(self, k) -> dict[str, set[str]]:
        return {k.fmt.name: {"quant"}, k.v_fmt.name: {"quant"}}  # the append quantizer

    def sized_head_dim(self, k) -> int | None:
        return k.max_head_dim if k.pair.append_staging else None  # its static staging

    # --- binding and launch
    entries = ("reshape_and_cache",)  # kgen.runtime's public calls

    def bind(self, k: Kernel, c: Checker, a: dict):
        """New rows into a contiguous cache (host, device or per-slot position) or into
        pages (position = paged: :meth:`_bind_paged`)."""
        if k.position is Position.PAGED:
            return self._bind_paged(k, c, a)
        return self._bind_contiguous(k, c, a)

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        """A block is head_dim threads, with the registers they need; rows are whole
        blocks of the format, within a staging format's static bound."""
        from kgen.runtime.checks import block_registers, check_head_dim

        check_head_dim(k, c, hd, rows=True)
        if k.pair.append_staging:
            c.require(hd <= k.max_head_dim, "static staging",
                      lambda: f"head_dim = {hd} exceeds the kernel's shared staging "
                      f"({k.max_head_dim})")
        block_registers(k, c, hd, hd)

    def _bind_contiguous(self, k: Kernel, c: Checker, a: dict):
        """The cache [n_head_kv][max_seq][row] (per slot: [nslots][...]); rows land from
        pos0 (host) or the device positions pos (one a slot, or one decode row)."""
        from kgen.runtime.checks import cache_arrays, cache_values, device_positions

        fmt = k.pair
        kn, vn = a["k_new"], a["v_new"]
        c.array("k_new", kn, np.float32, 3)
        c.array("v_new", vn, np.float32, 3)
        c.shape("v_new", vn, tuple(kn.shape))
        n, n_head_kv, hd = (int(x) for x in kn.shape)
        self.check_launch_shape(k, c, hd)
        lead = (n, n_head_kv) if k.position is Position.SLOTS else (n_head_kv,)
        max_seq = cache_arrays(k, c, a, lead, hd)
        values = dict(k_new=kn, v_new=vn, n_head_kv=n_head_kv, head_dim=hd, max_seq=max_seq)
        cache_values(k, c, a, values)
        if k.position is Position.HOST:
            pos0 = c.integer("pos0", a["pos0"], 0)
            c.require(pos0 + n <= INT_MAX, "int32 position", lambda: "pos0 + n overflows int")
            c.require(n <= max_seq, "ring write race",
                      lambda: f"a batch of {n} rows laps the {max_seq}-row ring inside one "
                      "launch (two blocks write one row)")
            if not fmt.append_wraps:
                c.require(pos0 + n <= max_seq, "no ring wrap",
                          lambda: f"{fmt.name} rows land at pos0 + t without wrapping: pos0 + n = "
                          f"{pos0 + n} > max_seq = {max_seq}")
            values["pos0"] = pos0
        else:
            device_positions(k, c, a, n if k.position is Position.SLOTS else 1, max_seq,
                             rows=1 if k.position is Position.SLOTS else n, wrap=fmt.append_wraps)
            values["pos"] = a["pos"]
            if k.position is Position.DEVICE:
                c.require(n == 1, "one decode row",
                          lambda: "the device-position append writes one row per launch "
                          f"(grid.x = 1); k_new has {n} rows")
        if values.get("win", 0) > 0:
            # Rows t and t + ring_rows of one batch share a ring slot and are written by
            # different blocks: the slot's final content would be a race.
            c.require(n <= k.ring_rows, "ring write race",
                      lambda: f"a batch of {n} rows with win > 0 laps the {k.ring_rows}-row "
                      "fp16 window ring inside one launch (two blocks write one slot); append in "
                      f"chunks of at most {k.ring_rows} rows")
        grid = (n, n_head_kv, 1)
        return grid, (hd, 1, 1), 0, values

    def _bind_paged(self, k: Kernel, c: Checker, a: dict):
        """Pages [num_blocks][block_size][n_head_kv][row]: token t's rows land in slot
        slot_mapping[t] (a negative slot skips it)."""
        from kgen.runtime.checks import cache_values, index, pages, slots_within

        kn, vn = a["k_new"], a["v_new"]
        c.array("k_new", kn, np.float32, 3)
        c.array("v_new", vn, np.float32, 3)
        c.shape("v_new", vn, tuple(kn.shape))
        n, hk, hd = (int(x) for x in kn.shape)
        self.check_launch_shape(k, c, hd)
        nb, bs, hk_c = pages(k, c, a, hd)
        c.require(hk_c == hk, "shape", lambda: f"k_new has {hk} kv heads, the cache {hk_c}")
        sm = index(c, a, "slot_mapping", (n,))
        if a.get("validate_pos", True):
            slots_within(c, sm, nb * bs)
        values = dict(k_new=kn, v_new=vn, k_cache=a["k_cache"], v_cache=a["v_cache"],
                      slot_mapping=sm, n_head_kv=hk, head_dim=hd)
        cache_values(k, c, a, values)
        return (n, hk, 1), (hd, 1, 1), 0, values

    # --- C++ view

    # --- contracts, reference and test cases


OP = KvAppend()
