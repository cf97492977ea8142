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

    # --- binding and launch

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

    def gpu_check(self, k, fn, case) -> None:
        from kgen.ir.axes import Position
        from kgen.testing import gpu, paged

        if k.position is Position.PAGED:
            return paged.check_append(k, fn, case)
        return gpu.check_append(k, fn, case)


OP = KvAppend()
