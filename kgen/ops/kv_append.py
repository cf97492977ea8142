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
from kgen.ops.base import OpDef, PublicCall

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
        out += cache_arrays(k, "", lambda role: k.pair.of(role).store_bytes)  # the writer
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
    listed = ("position:pos", "kv")  # kgen list
    def format_uses(self, k) -> dict[str, set[str]]:
        return {k.fmt.name: {"quant"}, k.v_fmt.name: {"quant"}}  # the append quantizer

    def sized_head_dim(self, k) -> int | None:
        return k.max_head_dim if k.pair.append_staging else None  # its static staging

    # --- binding and launch
    entries = ("reshape_and_cache",)  # kgen.runtime's public calls
    # slot_mapping: a PagedMetadata or an index tensor, which the call converts itself
    public_calls = (PublicCall("reshape_and_cache", writes=("key_cache", "value_cache"),
                               tensors=("slot_mapping",)),)

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
    mutated_array = "k_new"

    def contract_args(self, k, case, alloc) -> dict:
        import numpy as np

        from kgen.ir.axes import Position
        from kgen.testing.arguments import cache_args, tensor_scales
        from kgen.testing.paged import page_caches

        z, f32 = alloc, np.float32
        hd, hk = case.head_dim, case.n_head_kv
        if k.position is Position.PAGED:
            nb = -(-case.n // case.block_size) + 1
            a = dict(k_new=z((case.n, hk, hd), f32), v_new=z((case.n, hk, hd), f32),
                     **page_caches(k, case, z, nb), slot_mapping=np.arange(case.n, dtype=np.int32))
            a.update(tensor_scales(k, case))
            return a
        a = cache_args(k, case, z)
        slots = k.position is Position.SLOTS
        ns = len(case.positions) if slots else 0
        rows = ns if slots else (1 if k.position is Position.DEVICE else case.n)
        a.update(k_new=z((rows, hk, hd), f32), v_new=z((rows, hk, hd), f32))
        if k.position is Position.HOST:
            a["pos0"] = case.pos0
        else:
            a["pos"] = np.array(case.positions or (case.pos0,), dtype=np.int32)
        return a

    def call_args(self, call: str, k, case, alloc) -> dict | None:
        """reshape_and_cache over a paged append's case: its rows into its pages (of its
        one format) at its slots."""
        if k.position is not Position.PAGED or k.mixed:
            return None
        a = self.contract_args(k, case, alloc)
        return dict(key=a["k_new"], value=a["v_new"], key_cache=a["k_cache"],
                    value_cache=a["v_cache"], slot_mapping=a["slot_mapping"],
                    kv_cache_dtype=k.kv.value,
                    **{n: a[n] for n in ("k_scale", "v_scale") if n in a})

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.ir.axes import Position
        from kgen.ir.params import INT_MAX
        from kgen.testing.arguments import (
            Makers,
            Mutation,
            always,
            argument_mutations,
            cache_mutations,
            layout_mutations,
        )

        m, cache = Makers(self), cache_mutations(self)

        def host(k) -> bool:
            return k.position is Position.HOST

        def ring(k, c):
            """A host batch longer than the ring (or the cache) it writes."""
            return m.args(k, c.with_(
                n=(k.ring_rows if k.pair.shadows else c.max_seq) + 1, pos0=0,
                win=min(8, k.ring_rows),
                max_seq=(4 * k.ring_rows if k.pair.shadows else c.max_seq)))

        def paged(k) -> bool:
            return k.position is Position.PAGED
        return {
            **argument_mutations(self),
            "tensor_scale_not_positive": cache["tensor_scale_not_positive"],
            "head_dim_over_block": Mutation("block size", always, m.big_head_dim),
            "grid_y_over_limit": Mutation("grid", lambda k: k.position is not Position.SLOTS,
                                          m.shape_only(n_head_kv=70000)),
            "max_seq_over_int": Mutation("max_seq", host, m.shape_only(max_seq=INT_MAX + 1)),
            "int32_position": Mutation("int32 position", host, lambda k, c: {
                **m.args(k, c), "pos0": INT_MAX - 1}),
            **layout_mutations(self),
            "row_format_head_dim": cache["row_format_head_dim"],
            "negative_pos0": Mutation("range", host, m.at(pos0=-1)),
            "sink_rows": cache["sink_rows"],
            "window_ring": cache["window_ring"],
            "append_ring_race": Mutation("ring write race", host, ring),
            "device_append_rows": Mutation(
                "one decode row", lambda k: k.position is Position.DEVICE,
                lambda k, c: {**m.args(k, c), "k_new": np.zeros((2, c.n_head_kv, c.head_dim),
                                                                np.float32),
                              "v_new": np.zeros((2, c.n_head_kv, c.head_dim), np.float32)}),
            "negative_device_pos": cache["negative_device_pos"],
            "device_pos_past_max_seq": Mutation(
                "no ring wrap", lambda k: k.position in (Position.DEVICE, Position.SLOTS)
                and not k.pair.append_wraps,
                m.replace("pos", lambda a, k, c: np.full_like(a, c.max_seq))),
            "paged_slot_collision": Mutation("slot_mapping", paged, m.replace(
                "slot_mapping", lambda a, k, c: np.zeros_like(a))),
            "paged_slot_past_pages": Mutation("slot_mapping", paged, m.replace(
                "slot_mapping", lambda a, k, c: a + 10**6)),
        }

    def mutated_integer(self, k) -> str | None:
        from kgen.ir.axes import Position

        return "pos0" if k.position is Position.HOST else None

    def case_candidates(self, k) -> list:
        from kgen.ir.axes import Position
        from kgen.testing import shapes

        if k.position is Position.PAGED:
            return shapes.PAGED_APPEND
        return {Position.HOST: shapes.APPEND, Position.DEVICE: shapes.APPEND_DEV,
                Position.SLOTS: shapes.APPEND_SLOTS}[k.position]

    def case_required(self, k) -> list:
        from kgen.ir.axes import Position
        from kgen.testing.case import Case

        hd = self.case_smallest_head_dim(k)
        if k.position is Position.PAGED:
            return [Case(f"hd{hd}_smallest", n=3, n_head_kv=2, head_dim=hd, block_size=2)]
        if k.position is Position.SLOTS:
            return [Case(f"hd{hd}_smallest", n=2, n_head_kv=2, head_dim=hd, max_seq=8,
                         positions=(5, 0), sink=2, win=4)]
        n = 1 if k.position is Position.DEVICE else 3
        return [Case(f"hd{hd}_smallest", n=n, n_head_kv=2, head_dim=hd, max_seq=16, pos0=2,
                     positions=(2,) if k.position is Position.DEVICE else (), sink=4, win=8)]

    def case_smallest_head_dim(self, k) -> int:
        return k.pair.block

    def gpu_check(self, k, fn, case, find) -> None:
        from kgen.ir.axes import Position
        from kgen.testing import gpu, paged

        if k.position is Position.PAGED:
            return paged.check_append(k, fn, case)
        return gpu.check_append(k, fn, case)


OP = KvAppend()
