"""The op ``flash``: tiled online-softmax attention over the KV cache: prefill and split decode."""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class Flash(OpDef):
    op = Op.FLASH

    # --- spec: axes and checks
    cache = True
    planned = True

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases
    mutated_array = "q"
    case_retries_refused = True

    def contract_args(self, k, case, alloc) -> dict:
        import numpy as np

        from kgen import numpy_ref as ref
        from kgen.ir.axes import Mode, Position, Sinks
        from kgen.testing.arguments import NEUTRAL, cache_args, tensor_scales
        from kgen.testing.keywords import options, prefill_outputs
        from kgen.testing.paged import layout, page_caches

        z, f32, hd = alloc, np.float32, case.head_dim
        if k.position is Position.PAGED:
            lay = layout(case) if case.requests else None
            a = dict(**page_caches(k, case, z, lay["num_blocks"]),
                     block_table=lay["block_table"], seq_lens=lay["seq_lens"])
            reqs = len(case.requests)
            if k.mode is Mode.PREFILL:
                rows = int(lay["query_start_loc"][-1])
                a.update(q=z((rows, case.n_head, hd), f32),
                         query_start_loc=lay["query_start_loc"],
                         **prefill_outputs(k, rows, case.n_head, hd, z))
            else:
                heads = reqs * case.n_head
                a.update(q=z((reqs, case.n_head, hd), f32), m_out=z(heads * case.cap, f32),
                         l_out=z(heads * case.cap, f32), acc_out=z(heads * case.cap * hd, f32),
                         kps=case.kps, splits_cap=case.cap)
            a.update(**NEUTRAL, **options(k, case))
            if k.sinks is Sinks.LEARNED:
                a["sinks"] = z((case.n_head,), f32)
            a.update(tensor_scales(k, case))
            return a
        slots = k.position is Position.SLOTS
        ns = len(case.positions) if slots else 0
        a = cache_args(k, case, z)
        pos = np.array(case.positions or (case.seq_len - 1,), dtype=np.int32)
        a.update(**NEUTRAL, **options(k, case))
        if k.sinks is Sinks.LEARNED:
            a["sinks"] = z((case.n_head,), f32)
        if k.mode is Mode.PREFILL:
            a.update(q=z((case.n, case.n_head, hd), f32), pos0=case.pos0,
                     **prefill_outputs(k, case.n, case.n_head, hd, z))
            return a
        heads = case.n_head * (ns or 1)
        a["q"] = z((ns, case.n_head, hd), f32) if slots else z((case.n_head, hd), f32)
        a.update(m_out=z(heads * case.cap, f32), l_out=z(heads * case.cap, f32),
                 acc_out=z(heads * case.cap * hd, f32))
        if k.position is Position.HOST:
            plan = ref.decode_plan(case.seq_len, case.kps, case.cap)
            a.update(seq_len=case.seq_len, n_splits=plan[0], split_len=plan[1])
        else:
            a.update(pos=pos, kps=case.kps, splits_cap=case.cap)
        return a

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.ir.axes import KStage, Mode, Position, Sinks, SoftCap, VStage, Window
        from kgen.ir.geometry import (
            block_threads,
            flash_shared_bytes,
            head_dim_step,
            min_head_dim,
            padded,
            query_tiles,
            stream_head_dim,
            stream_hoisted,
            tile_threads,
        )
        from kgen.ir.target import TARGET
        from kgen.testing.arguments import (
            Makers,
            Mutation,
            always,
            argument_mutations,
            cache_mutations,
            layout_mutations,
        )

        m, cache = Makers(self), cache_mutations(self)

        def paged(k) -> bool:
            return k.position is Position.PAGED

        def paged_prefill(k) -> bool:
            return paged(k) and k.mode is Mode.PREFILL

        def decode_host(k) -> bool:
            return k.mode is Mode.DECODE and k.position is Position.HOST

        def below_tile(k) -> int | None:
            """A head_dim that passes the warp and block rules but leaves keys unscored."""
            step = head_dim_step(k)
            hd = (tile_threads(k) - 1) // step * step
            while hd >= step and block_threads(k, hd) >= tile_threads(k):
                hd -= step
            return hd if hd >= step else None

        def partial_warp(k) -> int | None:
            """A head_dim above the tile that is whole format blocks but not whole warps
            (a block of head_dim threads only: not a query_tile block, sized by its
            tile)."""
            hd = -(-tile_threads(k) // TARGET.warp) * TARGET.warp + TARGET.warp // 2
            return hd if (k.pair.accepts_head_dim(hd) and not padded(k)
                          and not query_tiles(k)) else None

        def partial_chunk(k) -> int | None:
            """A head_dim a whole-warp block runs but its dot lanes cannot split evenly."""
            hd = min_head_dim(k) + k.dot_lanes // 2
            return hd if padded(k) and k.dot_lanes > 1 and k.pair.accepts_head_dim(hd) \
                else None

        def over_chunk(k) -> int | None:
            """The smallest legal-looking head_dim past the register-K chunk bound."""
            step = head_dim_step(k)
            hd = (k.kreg_max_chunk * k.dot_lanes // step + 1) * step
            return hd if hd <= TARGET.max_threads else None

        def over_shared(k) -> bool:
            """A launch whose shared memory grows past a block's (a query_tile kernel's
            is bounded by max_head_dim, which the spec checks fit)."""
            return (k.k_stage is not KStage.REGISTERS and k.v_stage is VStage.GLOBAL and
                    not query_tiles(k) and flash_shared_bytes(
                        k, k.max_groups, TARGET.max_threads) > TARGET.shared_per_block)

        def over_tile_width(k) -> int | None:
            """query_tile: the first head_dim of whole format blocks past max_head_dim
            (no wider than a block may be threads, which is refused as such)."""
            hd = (k.max_head_dim // k.pair.block + 1) * k.pair.block
            return hd if query_tiles(k) and hd <= TARGET.max_threads else None
        return {
            **argument_mutations(self),
            "scale_not_finite": Mutation("scale", always, lambda k, c: {
                **m.args(k, c), "scale": float("inf")}),
            "scale_overflows_float32": Mutation("scale", always, lambda k, c: {
                **m.args(k, c), "scale": 1e300}),
            "negative_window": Mutation("range", always, lambda k, c: {
                **m.args(k, c), **({"win_left": -5} if k.window is Window.EXACT
                                   else {"attn_win": -5})}),
            "tensor_scale_not_positive": cache["tensor_scale_not_positive"],
            "softcap_not_finite": Mutation("softcap", lambda k: k.softcap is SoftCap.TANH,
                                           lambda k, c: {**m.args(k, c),
                                                         "softcap": float("nan")}),
            "sinks_wrong_size": Mutation("shape", lambda k: k.sinks is Sinks.LEARNED,
                                         lambda k, c: {**m.args(k, c),
                                                       "sinks": np.zeros(1, np.float32)}),
            "head_dim_over_block": Mutation("block size", lambda k: not query_tiles(k),
                                            m.big_head_dim),
            "head_dim_over_tile": Mutation(
                "head_dim range", lambda k: over_tile_width(k) is not None,
                lambda k, c: m.args(k, c.with_(head_dim=over_tile_width(k), n_head=2,
                                               n_head_kv=2))),
            "qtile_int32_rows": Mutation("int32 index",
                                         lambda k: query_tiles(k) and not paged(k),
                                         m.shape_only(n=2**28 + 1, n_head=16, n_head_kv=2,
                                                      max_seq=2**28 + 1, pos0=0)),
            "qtile_paged_int32_rows": Mutation(
                "int32 index", lambda k: query_tiles(k) and paged(k),
                m.shape_only(requests=((2**28 + 1, 2**28 + 1),), n_head=16, n_head_kv=2,
                             block_size=2**20)),
            **layout_mutations(self),
            "head_dim_below_tile": Mutation(
                "every key scored", lambda k: below_tile(k) is not None,
                lambda k, c: m.args(k, c.with_(head_dim=below_tile(k)))),
            "head_dim_partial_warp": Mutation(
                "whole warps", lambda k: partial_warp(k) is not None,
                lambda k, c: m.args(k, c.with_(head_dim=partial_warp(k)))),
            "head_dim_partial_chunk": Mutation(
                "dot chunks", lambda k: partial_chunk(k) is not None,
                lambda k, c: m.args(k, c.with_(head_dim=partial_chunk(k)))),
            "row_format_head_dim": cache["row_format_head_dim"],
            "kv_groups_over_max": Mutation("kv_groups", always, lambda k, c: m.args(
                k, c.with_(n_head=2 * (k.max_groups + 1), n_head_kv=2))),
            "gqa_mismatch": Mutation("GQA", always, m.at(n_head=7, n_head_kv=2)),
            "shared_memory": Mutation("shared memory", over_shared, lambda k, c: m.args(
                k, c.with_(head_dim=TARGET.max_threads, n_head=k.max_groups, n_head_kv=1))),
            "register_k_chunk": Mutation("register K chunk", lambda k: k.k_stage is
                                         KStage.REGISTERS and over_chunk(k) is not None
                                         and not stream_hoisted(k),
                                         lambda k, c: m.args(k, c.with_(
                                             head_dim=over_chunk(k), n_head=2, n_head_kv=2))),
            "hoisted_chunk": Mutation("hoisted chunk", stream_hoisted, lambda k, c: m.args(
                k, c.with_(head_dim=stream_head_dim(k) - head_dim_step(k)))),
            "prefill_ring_wrap": Mutation("no ring wrap", lambda k: k.mode is Mode.PREFILL
                                          and not paged(k), lambda k, c: m.args(
                                              k, c.with_(pos0=c.max_seq - c.n + 1))),
            "negative_pos0": Mutation("range", lambda k: k.position is Position.HOST and
                                      k.mode is Mode.PREFILL, m.at(pos0=-1)),
            "sink_rows": cache["sink_rows"],
            "window_ring": cache["window_ring"],
            "decode_past_max_seq": Mutation("no ring wrap", decode_host, lambda k, c: {
                **m.args(k, c), "seq_len": c.max_seq + 1}),
            "decode_bad_plan": Mutation("split plan", decode_host, lambda k, c: {
                **m.args(k, c), "n_splits": m.args(k, c)["n_splits"] + 1}),
            "split_len_not_tiles": Mutation("split plan", decode_host, lambda k, c: {
                **m.args(k, c), "split_len": k.tile_keys + 1}),
            "negative_device_pos": cache["negative_device_pos"],
            "device_pos_past_max_seq": Mutation(
                "no ring wrap", lambda k: k.position in (Position.DEVICE, Position.SLOTS),
                m.replace("pos", lambda a, k, c: np.full_like(a, c.max_seq))),
            "slots_launch_too_narrow": Mutation(
                "slot plan coverage", lambda k: k.position is Position.SLOTS,
                lambda k, c: {**m.args(k, c), "launch_splits": 1}),
            "paged_seq_len_past_table": Mutation("seq_lens", paged, m.replace(
                "seq_lens", lambda a, k, c: a + 10**6)),
            "paged_block_outside_pages": Mutation("block_table", paged, m.replace(
                "block_table", lambda a, k, c: a + 10**6)),
            "paged_query_rows_mismatch": Mutation("query_start_loc", paged_prefill, m.replace(
                "query_start_loc", lambda a, k, c: a * 2)),
            "paged_max_query_len_too_small": Mutation(
                "max_query_len", paged_prefill, lambda k, c: {
                    **m.args(k, c), "max_query_len": max(q for q, _ in c.requests) - 1}),
            "paged_max_query_len_over_rows": Mutation(
                "max_query_len", paged_prefill, lambda k, c: {
                    **m.args(k, c), "max_query_len": sum(q for q, _ in c.requests) + 1}),
            "paged_max_seq_len_too_small": Mutation(
                "max_seq_len", lambda k: paged(k) and k.mode is Mode.DECODE,
                lambda k, c: {**m.args(k, c), "max_seq_len": 1}),
            "partials_too_small": Mutation(
                "partials size", lambda k: k.mode is Mode.DECODE,
                lambda k, c: {**m.args(k, c), "acc_out": np.zeros(8, np.float32)}),
        }

    def mutated_integer(self, k) -> str | None:
        from kgen.ir.axes import Mode, Position

        if k.position is Position.HOST:
            return "pos0" if k.mode is Mode.PREFILL else "seq_len"
        if k.position is Position.PAGED:
            return "kps" if k.mode is Mode.DECODE else None
        return "kps"

    def case_candidates(self, k) -> list:
        from kgen.ir.axes import Mode, Position
        from kgen.ir.geometry import query_tiles
        from kgen.testing import shapes

        if k.position is Position.PAGED:
            if k.mode is Mode.DECODE:
                return shapes.PAGED_DECODE
            return shapes.PAGED_PREFILL + shapes.paged_query_tile_cases(k) if query_tiles(k) \
                else shapes.PAGED_PREFILL
        if k.mode is Mode.PREFILL:
            return shapes.PREFILL + shapes.query_tile_cases(k) if query_tiles(k) \
                else shapes.PREFILL
        return shapes.DECODE_SLOTS if k.position is Position.SLOTS else shapes.DECODE

    def case_required(self, k) -> list:
        from kgen.testing.shapes import flash_case, flash_shapes, option_cases

        out = [flash_case(k, hd, groups, f"hd{hd}_g{groups}_partial_tile")
               for hd, groups in flash_shapes(k)]
        return out + option_cases(k, out[-1] if len(out) < 3 else out[1])

    def case_smallest_head_dim(self, k) -> int:
        from kgen.ir.geometry import min_head_dim

        return min_head_dim(k)

    def case_registers_bound(self, k) -> bool:
        from kgen.ir.geometry import query_tiles

        return not query_tiles(k)

    def gpu_check(self, k, fn, case) -> None:
        from kgen.ir.axes import Position
        from kgen.testing import gpu, paged

        if k.position is Position.PAGED:
            return paged.check_attention(k, fn, case)
        return gpu.check_flash(k, fn, case)


OP = Flash()
