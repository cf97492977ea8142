"""The op ``flash``: tiled online-softmax attention over the KV cache: prefill and split decode."""

from __future__ import annotations

from kgen.ir.axes import KStage, Mode, Op, Position, Schedule, VStage
from kgen.ops.base import OpDef


class Flash(OpDef):
    op = Op.FLASH

    # --- spec: axes and checks
    cache = True
    planned = True

    # --- signature and geometry

    # --- render
    grouped_block = True
    lists_occupancy = True

    def kernel_template(self, k) -> str:
        # warp_stream and query_tile have skeletons of their own (over the same format macros)
        from kgen.ir.geometry import qtile_swizzle, qtile_vec4

        if k.schedule is Schedule.WARP_STREAM:
            return "kernels/flash_stream.cu.j2"
        if k.schedule is Schedule.QUERY_TILE:
            if qtile_swizzle(k):
                return "kernels/flash_qtile_swizzle.cu.j2"
            return ("kernels/flash_qtile_vec4.cu.j2" if qtile_vec4(k)
                    else "kernels/flash_qtile.cu.j2")
        return super().kernel_template(k)

    def template_schedule(self, k) -> Schedule:
        return k.schedule

    def template_mode(self, k) -> Mode:
        return k.mode

    def render_flags(self, k) -> frozenset[str]:
        # the window helpers (the exact window's too where asked), the page table's, and
        # cuda_fp16.h for a __half shared region
        return frozenset({"window", *(("exact_window",) if k.exact_window else ()),
                          *(("paged",) if k.paged else ()),
                          *(("fp16",) if k.byte_layout else ())})

    def template_parts(self, k) -> tuple[str, ...]:
        return ("kernels/flash_parts.j2",)

    def format_uses(self, k) -> dict[str, set[str]]:
        # the one-element reader (K tile staging, global V reads), the lane-chunk reader
        # (register K) and the quad reader (geometry.quad_reads)
        from kgen.ir.geometry import quad_reads

        kf, vf = k.fmt.name, k.v_fmt.name
        out: dict[str, set[str]] = {kf: {"lane_chunk"} if k.k_registers else {"elem"}}
        if not k.v_tile:  # V read element by element (a raw V tile decodes in place)
            out.setdefault(vf, set()).add("elem")
        else:
            out.setdefault(vf, set())
        if quad_reads(k.k):  # K and V a quad a load (the formats' quad readers)
            out[kf].add("quad")
            out[vf].add("quad")
        return out

    def sized_head_dim(self, k) -> int | None:
        # a query_tile thread's output patch, the shared-V tile, register K's chunk
        from kgen.ir.geometry import query_tiles, tile_threads

        if query_tiles(k):
            return k.max_head_dim
        if k.v_stage is VStage.SHARED_Q4:
            return tile_threads(k)
        if k.k_stage is KStage.REGISTERS:
            return k.kreg_max_chunk * k.dot_lanes
        return None

    def served_step(self, k) -> int | None:
        # a tiled or streamed block's shared memory varies with head_dim and groups; a
        # query_tile block is fixed and its shared memory grows with head_dim
        from kgen.ir.geometry import head_dim_step, query_tiles

        return None if query_tiles(k) else head_dim_step(k)

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # its shared memory dynamic: the groups' rows of each of its query rows
        from kgen.ir.geometry import block_threads, flash_shared_bytes

        return block_threads(k, hd), flash_shared_bytes(k, groups * k.rows_per_block, hd)

    def occupancy_block(self, k, hd: int, groups: int | None) -> tuple[int, int]:
        from kgen.ir.geometry import block_threads, flash_shared_bytes

        return block_threads(k, hd), flash_shared_bytes(k, groups, hd)

    def limit_facts(self, k) -> dict:
        return {"tile_keys": k.tile_keys, "dot_lanes": k.dot_lanes}

    # --- binding and launch

    # --- C++ view
    def cpp_view(self, k, hd, groups, rows) -> dict:
        # the geometry as the Python functions compute it (symbolic arguments)
        from kgen.ir import geometry as geo

        tiles = geo.query_tiles(k)
        quads = geo.quad_reads(k)
        return super().cpp_view(k, hd, groups, rows) | {
            "query_tiles": tiles, "padded": geo.padded(k), "hoisted": geo.stream_hoisted(k),
            "key_partials": geo.key_partials(k),
            "stream_head_dim": geo.stream_head_dim(k) if geo.streams(k) else 0,
            "tile_threads": geo.tile_threads(k),
            "out_cols": geo.out_cols(k) if tiles else 0,
            "row_lanes": geo.row_lanes(k) if tiles else 0,
            "head_dim_step": geo.head_dim_step(k) if tiles else 0,
            "k_quad_align": k.fmt.quad_bytes if quads else 0,
            "v_quad_align": k.v_fmt.quad_bytes if quads else 0,
            "block_threads": geo.block_threads(k, hd),
            "shared_bytes": geo.flash_shared_bytes(k, groups, hd),
            # x of a prefill's grid in its query rows (a paged form: the batch's rows, or
            # for a query tile the bound on one request's rows, max_query_len)
            "prefill_grid_x": (None if k.mode is not Mode.PREFILL else
                               geo.paged_prefill_grid(k, rows, rows, groups, 1, 1)[0]
                               if k.position is Position.PAGED else
                               geo.prefill_grid(k, rows, groups, 1)[0]),
        }

    # --- contracts, reference and test cases


OP = Flash()
