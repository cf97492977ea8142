"""The op ``flash``: tiled online-softmax attention over the KV cache: prefill and split decode."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import (
    KEYS,
    KeySplit,
    KStage,
    LaneDims,
    Mask,
    Mode,
    Op,
    Position,
    Prefetch,
    QStage,
    RingFloor,
    Schedule,
    Sinks,
    SoftCap,
    VStage,
    Window,
)
from kgen.ir.pyapi import PyArg
from kgen.ir.signature import cache_arrays, fixed, position_params
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class Flash(OpDef):
    op = Op.FLASH

    # --- spec: axes and checks
    cache = True
    planned = True
    own_keys = frozenset({
        "mode", "position", "q_stage", "k_stage", "v_stage", "threads", "schedule",
        "keys_per_step", "window", "mask", "softcap", "sinks", "ring_floor", "stream_loads",
        "stream_steps", "lane_dims", "prefetch", "tile_keys", "dot_lanes", "max_groups",
        "rows_per_block", "k_pad", "kreg_max_chunk", "v_rounds", "max_head_dim", "tile_rows",
        "micro_rows", "micro_keys", "min_blocks", "qk_split", "qtile_loads", "key_split"})
    # The keys only a warp_stream kernel reads, and those of them a query_tile kernel reads
    # too (the swizzled tile's prefetch).
    STREAM_KEYS = ("keys_per_step", "stream_loads", "stream_steps", "lane_dims", "prefetch")
    QUERY_TILE_STREAM_KEYS = ("prefetch",)
    # The keys only a query_tile kernel reads (the tile shape and the head_dim bound of a
    # thread's output patch); max_head_dim is also the append kernels' staging bound.
    QUERY_TILE_KEYS = ("tile_rows", "micro_rows", "micro_keys", "max_head_dim", "qtile_loads",
                       "key_split", "qk_split", "min_blocks")
    # Options a query_tile kernel with vec4 loads does not have yet (none of the engine's;
    # the scalar and swizzled tiles have them all), and the staging axes it fixes itself.
    QUERY_TILE_VEC4_NOT_YET = ("window", "softcap", "sinks")
    QUERY_TILE_FIXED = ("q_stage", "k_stage", "v_stage", "threads", "rows_per_block")
    QUERY_TILE_MAX_ACCUMULATORS = 128  # output floats a thread keeps in registers
    # qtile_loads = swizzle: a thread xors its float4 index with its rows' (and keys') row
    # index mod this, once per dim step for all of them.
    SWIZZLE_ROWS = 8

    def check_mode_position(self, k: Kernel, ctx: Ctx) -> None:
        """Prefill reads pos0 from the host (or a varlen batch from a paged cache's
        index tensors)."""
        if k.mode is Mode.PREFILL and k.position not in (Position.HOST, Position.PAGED):
            raise ctx.error(k.where("position"), "prefill takes its position from the host "
                            "(position = host) or a paged varlen batch (position = paged); "
                            "device/slots positions are decode modes")

    def check_attention_options(self, k: Kernel, ctx: Ctx) -> None:
        """A full (non-causal) mask is a prefill form (a decode query is the last
        position); a split decode leaves learned sinks to its combine, which sees the
        whole denominator."""
        if k.mode is Mode.PREFILL:
            return
        if k.mask is Mask.FULL:
            raise ctx.error(k.where("mask"), "mask = full needs mode = prefill (a decode query "
                            "is the last position: it sees every key already)")
        if k.sinks is Sinks.LEARNED:
            raise ctx.error(k.where("sinks"), "a split decode kernel cannot add the sinks (each "
                            "split sees part of the denominator): set sinks = learned on the "
                            "decode_combine kernel")

    def check_rows_per_block(self, k: Kernel, ctx: Ctx) -> None:
        """Several query rows per block share each staged K/V tile: a causal prefill over
        a contiguous cache whose rows all read the same values (no fp16 shadows: which
        shadow a key comes from depends on the row) with the tile-granular window, and
        one fold thread per (row, head) inside the first warp."""
        from kgen.compiler.spec.contract import blame, kv_said

        if k.rows_per_block == 1:
            return
        where = k.where("rows_per_block")
        if k.mode is not Mode.PREFILL or k.position is not Position.HOST:
            raise ctx.error(where, "rows_per_block > 1 needs a contiguous prefill (mode = "
                            "prefill, position = host)")
        if k.pair.shadows:
            raise ctx.error(where, f"rows_per_block > 1: {kv_said(k)} picks a key's fp16 "
                            "shadow by the row's position, so rows cannot share a K tile")
        other = [key for key in ("window", "mask", "softcap", "sinks", "v_stage")
                 if getattr(k, key) != KEYS[key].default]
        if other:
            raise ctx.error(blame(k, "rows_per_block", *other), "rows_per_block > 1 does not "
                            "combine with " + ", ".join(f"{key} = {getattr(k, key).value}"
                                                        for key in other)
                            + " yet (not supported yet: the multi-row prefill has the plain "
                            "options only)")
        if k.max_groups * k.rows_per_block > TARGET.warp:
            raise ctx.error(where, f"rows_per_block * max_groups = "
                            f"{k.max_groups * k.rows_per_block} > {TARGET.warp}: the fold runs one "
                            "thread per (row, head) inside the first warp")

    def check_schedule(self, k: Kernel, ctx: Ctx) -> None:
        """warp_stream runs over one contiguous sequence (a split decode at a host or
        device position, or a prefill row per block), its units reading K straight into
        registers and V from global memory; keys_per_step bounds the keys (and
        registers) a unit has in flight. query_tile is a contiguous prefill over a cache
        whose keys read the same for every row, with f32 tiles of a shape that fits a
        block (_check_query_tile); its shape keys mean nothing to the other schedules."""
        from kgen.compiler.spec.contract import blame
        from kgen.ir.geometry import padded, stream_head_dim, stream_hoisted

        if k.schedule is not Schedule.QUERY_TILE:
            for key in self.QUERY_TILE_KEYS:
                if key in k.explicit_keys:
                    raise ctx.error(k.where(key), f"{key} applies to a flash kernel of schedule = "
                                    "query_tile only")
        if k.schedule is Schedule.QUERY_TILE:
            for key in self.STREAM_KEYS:
                if key in k.explicit_keys and key not in self.QUERY_TILE_STREAM_KEYS:
                    raise ctx.error(k.where(key), f"{key} applies to schedule = warp_stream only")
            self._check_query_tile(k, ctx)
            return
        if k.schedule is not Schedule.WARP_STREAM:
            for key in self.STREAM_KEYS:
                if key in k.explicit_keys:
                    raise ctx.error(k.where(key), f"{key} applies to schedule = warp_stream only")
            return
        where = k.where("schedule")
        per_request = (Position.SLOTS, Position.PAGED) if k.mode is Mode.DECODE else ()
        if k.position not in (Position.HOST, Position.DEVICE, *per_request):
            where = blame(k, "schedule", "position")
            raise ctx.error(where, "schedule = warp_stream prefill reads one contiguous sequence "
                            "from a host or device position (position = host or device); its "
                            "paged and per-slot forms are decode only")
        if k.rows_per_block != 1:
            raise ctx.error(k.where("rows_per_block"), "schedule = warp_stream serves one query "
                            "row per block (rows_per_block = 1)")
        if k.k_stage is not KStage.REGISTERS or k.v_stage is not VStage.GLOBAL:
            raise ctx.error(where, "schedule = warp_stream reads K into registers and V from "
                            "global memory (k_stage = registers, v_stage = global)")
        if stream_hoisted(k):
            hd = stream_head_dim(k)
            # A head_dim of part of a warp runs in a block padded to whole warps (threads =
            # warps): the threads past head_dim stream keys and own no output dim.
            if (hd % TARGET.warp and not padded(k)) or not k.pair.accepts_head_dim(hd):
                raise ctx.error(k.where("stream_loads"), f"stream_loads = hoisted serves head_dim "
                                f"= kreg_max_chunk * dot_lanes = {hd} only: it must be whole warps "
                                f"(a multiple of {TARGET.warp}, or a block of threads = warps) and "
                                f"whole {k.pair.name} blocks")
        if k.lane_dims is LaneDims.QUADS:
            self._check_lane_quads(k, ctx)
        elif k.prefetch is not Prefetch.NONE:
            raise ctx.error(blame(k, "prefetch", "lane_dims"), f"prefetch = {k.prefetch.value} "
                            "needs lane_dims = quads (the quad loads are what run a step ahead)")
        if not 1 <= k.keys_per_step <= 8:
            raise ctx.error(k.where("keys_per_step"), f"keys_per_step = {k.keys_per_step}: "
                            "1 to 8 keys per unit in flight (each holds a K and a V chunk in "
                            "registers)")

    def _check_lane_quads(self, k: Kernel, ctx: Ctx) -> None:
        """lane_dims = quads: a lane's dims are whole float4s at compile-time places (one
        head_dim: stream_loads = hoisted; kreg_max_chunk a multiple of 4), q read a float4 a
        load (q_stage = f32), K and V by the formats' quad readers (a format with fp16
        window shadows picks a key's row there by the block's one query row)."""
        from kgen.compiler.spec.contract import blame
        from kgen.ir.geometry import stream_hoisted

        if not stream_hoisted(k):
            raise ctx.error(blame(k, "lane_dims", "stream_loads"), "lane_dims = quads needs "
                            "stream_loads = hoisted (one head_dim: a lane's quads at "
                            "compile-time places)")
        if k.kreg_max_chunk % 4:
            raise ctx.error(blame(k, "lane_dims", "kreg_max_chunk"), f"lane_dims = quads: a "
                            f"lane's kreg_max_chunk = {k.kreg_max_chunk} dims must be whole "
                            "float4s (a multiple of 4)")
        if k.q_stage is not QStage.F32:
            raise ctx.error(blame(k, "lane_dims", "q_stage"), "lane_dims = quads reads the q "
                            "group a float4 at a time: q_stage = f32")

    def _check_query_tile(self, k: Kernel, ctx: Ctx) -> None:
        """schedule = query_tile: a prefill, of a contiguous sequence (position = host) or
        a paged varlen batch (position = paged, scalar loads); fp16 shadows (which a row
        picks by its own position) with swizzled loads only, each tile in two passes, its
        loads in place (prefetch = none); either mask, the tile-granular or the key-exact
        window, soft-cap and learned sinks (with scalar loads; vec4 loads the tile-granular
        window only); f32 tiles in shared memory (the staging axes at their defaults);
        micro-tiles that
        divide the tile, a row's lanes inside one warp (its max and sum reduce by
        shuffles), whole warps, an output patch that fits the registers, and min_blocks
        blocks that fit an SM's threads."""
        from kgen.compiler.spec.contract import blame, kv_said, shadow_key
        from kgen.ir.geometry import (
            accumulators,
            qtile_swizzle,
            qtile_threads,
            qtile_vec4,
            row_lanes,
        )

        where = k.where("schedule")
        if k.mode is not Mode.PREFILL or k.position not in (Position.HOST, Position.PAGED):
            raise ctx.error(where, "schedule = query_tile "
                            "serves a prefill only (mode = prefill, position = host or paged); "
                            "its decode forms are not supported yet")
        if k.position is Position.PAGED and qtile_vec4(k):
            raise ctx.error(blame(k, "qtile_loads", "position"), "schedule = query_tile over "
                            "pages (position = paged) has scalar or swizzled loads only "
                            "(qtile_loads = scalar or swizzle) yet")
        if k.pair.shadows and not qtile_swizzle(k):
            raise ctx.error(blame(k, shadow_key(k), "qtile_loads"), f"schedule = query_tile "
                            f"with {kv_said(k)}: a key's fp16 shadow (sink rows, window ring) "
                            "depends on the row's position, which only the swizzled tile "
                            "(qtile_loads = swizzle) serves, a tile in two passes")
        if k.pair.shadows and k.prefetch is not Prefetch.NONE:
            raise ctx.error(blame(k, "prefetch", shadow_key(k)), f"prefetch = "
                            f"{k.prefetch.value} with {kv_said(k)}: a tile of fp16 shadows runs "
                            "in two passes, each loading its keys in place (prefetch = none)")
        for key in self.QUERY_TILE_VEC4_NOT_YET if qtile_vec4(k) else ():
            if getattr(k, key) != KEYS[key].default:
                raise ctx.error(k.where(key), f"schedule = query_tile with qtile_loads = vec4 "
                                f"does not combine with {key} = {getattr(k, key).value} yet")
        for key in self.QUERY_TILE_FIXED:
            default = KEYS[key].default
            if getattr(k, key) != default:
                raise ctx.error(k.where(key), f"schedule = query_tile stages q, K and V as f32 "
                                f"tiles in shared memory and sizes its own block: {key} keeps "
                                f"its default ({getattr(default, 'value', default)})")
        for whole, part in (("tile_rows", "micro_rows"), ("tile_keys", "micro_keys")):
            if getattr(k, whole) % getattr(k, part):
                raise ctx.error(k.where(part), f"{part} = {getattr(k, part)} must divide "
                                f"{whole} = {getattr(k, whole)} (a thread's patch of the tile)")
        lanes = row_lanes(k)
        if lanes & (lanes - 1) or lanes > TARGET.warp:
            raise ctx.error(k.where("micro_keys"), f"tile_keys / micro_keys = {lanes} lanes share "
                            f"a row: a power of two no larger than the warp ({TARGET.warp}), so a "
                            "row's max and sum reduce by shuffles inside one warp")
        threads = qtile_threads(k)
        if threads % TARGET.warp or not TARGET.fits_block(threads):
            raise ctx.error(k.where("tile_rows"), f"(tile_rows / micro_rows) * (tile_keys / "
                            f"micro_keys) = {threads} threads: a block of whole warps, at most "
                            f"{TARGET.max_threads}")
        if k.max_head_dim < k.pair.block:
            raise ctx.error(k.where("max_head_dim"), f"max_head_dim = {k.max_head_dim} admits no "
                            f"head_dim: a {kv_said(k)} row is whole blocks of "
                            f"{k.pair.block} values")
        if qtile_swizzle(k):
            self._check_swizzle(k, ctx)
        elif k.prefetch is not Prefetch.NONE:
            raise ctx.error(blame(k, "prefetch", "qtile_loads"), f"prefetch = "
                            f"{k.prefetch.value} on a query tile needs qtile_loads = swizzle (the "
                            "format's raw quad loads are what run a tile ahead)")
        if k.qk_split != 1:
            self._check_qk_split(k, ctx)
        if k.min_blocks * threads > TARGET.threads_per_sm or k.min_blocks > TARGET.blocks_per_sm:
            raise ctx.error(k.where("min_blocks"), f"min_blocks = {k.min_blocks} blocks of "
                            f"{threads} threads: an SM holds {TARGET.threads_per_sm} threads and "
                            f"{TARGET.blocks_per_sm} blocks")
        if k.key_split is KeySplit.PARTIALS:
            self._check_key_split(k, ctx)
        if qtile_vec4(k) and (k.k_pad % 4 or k.tile_keys % 4):
            raise ctx.error(k.where("qtile_loads"), f"qtile_loads = vec4 reads float4s: k_pad = "
                            f"{k.k_pad} and tile_keys = {k.tile_keys} must be multiples of 4 (rows "
                            "of the q, K/V and P tiles 16-byte aligned)")
        if accumulators(k) > self.QUERY_TILE_MAX_ACCUMULATORS:
            raise ctx.error(k.where("max_head_dim"), f"micro_rows * max_head_dim / {lanes} lanes "
                            f"= {accumulators(k)} output floats a thread: at most "
                            f"{self.QUERY_TILE_MAX_ACCUMULATORS} stay in sm_37's registers (lower "
                            "max_head_dim or micro_rows)")
        patch = k.micro_rows * k.micro_keys
        if accumulators(k) + patch > TARGET.registers_per_thread:
            raise ctx.error(blame(k, "micro_rows", "micro_keys"), f"micro_rows * micro_keys = "
                            f"{patch} scores and {accumulators(k)} output floats a thread keeps in "
                            f"registers: {accumulators(k) + patch}, and a thread has "
                            f"{TARGET.registers_per_thread}")

    def _check_swizzle(self, k: Kernel, ctx: Ctx) -> None:
        """qtile_loads = swizzle: rows carry no pad (k_pad = 0: the swizzle spreads them
        over the banks), and a thread's rows (ty + i * row_groups) and keys (tx + j *
        row_lanes) share one row index mod 8, so one xor serves all of its loads of a dim
        step: row_groups and row_lanes whole multiples of 8 (or a single key a lane)."""
        from kgen.compiler.spec.contract import blame
        from kgen.ir.geometry import row_groups, row_lanes

        if k.k_pad != 0:
            raise ctx.error(k.where("k_pad"), f"qtile_loads = swizzle permutes each row's "
                            f"float4s instead of padding rows: k_pad = {k.k_pad} must be 0")
        if row_groups(k) % self.SWIZZLE_ROWS:
            raise ctx.error(blame(k, "micro_rows", "tile_rows"), f"qtile_loads = swizzle: "
                            f"tile_rows / micro_rows = {row_groups(k)} row groups must be a "
                            f"multiple of {self.SWIZZLE_ROWS} (a thread's rows share one swizzle)")
        if row_lanes(k) % self.SWIZZLE_ROWS and k.micro_keys > 1:
            raise ctx.error(blame(k, "micro_keys", "tile_keys"), f"qtile_loads = swizzle: "
                            f"tile_keys / micro_keys = {row_lanes(k)} lanes a row must be a "
                            f"multiple of {self.SWIZZLE_ROWS} (a thread's keys share one swizzle)")

    def _check_qk_split(self, k: Kernel, ctx: Ctx) -> None:
        """qk_split > 1: the swizzled query tile (its q and K rows) with one share of head_dim
        a warp, the shares in whole swizzle groups; a warp's 8 x 4 lanes divide the tile
        and land on the thread patches (row_groups a multiple of 8, row_lanes of 4); the
        warps' partial scores fit in the K tile they replace; a lane's patch of them fits
        its registers beside its output floats."""
        from kgen.compiler.spec.contract import blame
        from kgen.ir.geometry import (
            QK_KEY_GROUPS,
            QK_ROW_GROUPS,
            accumulators,
            qk_patch,
            qtile_swizzle,
            qtile_threads,
            row_groups,
            row_lanes,
            swizzle_stride,
        )

        where = k.where("qk_split")
        if not qtile_swizzle(k):
            raise ctx.error(blame(k, "qk_split", "qtile_loads"), "qk_split splits the swizzled "
                            "query tile's S (qtile_loads = swizzle) only")
        warps = qtile_threads(k) // TARGET.warp
        if k.qk_split != warps:
            raise ctx.error(where, f"qk_split = {k.qk_split}: one share of head_dim a warp, and "
                            f"the block has {warps} (qk_split = 1 or {warps})")
        quads = swizzle_stride(k) // 4
        if quads % (k.qk_split * self.SWIZZLE_ROWS):
            raise ctx.error(where, f"qk_split = {k.qk_split} shares of {quads} float4s a row: "
                            f"each must be whole swizzle groups of {self.SWIZZLE_ROWS} (raise "
                            "max_head_dim)")
        if row_groups(k) % QK_ROW_GROUPS or row_lanes(k) % QK_KEY_GROUPS:
            raise ctx.error(blame(k, "qk_split", "tile_rows"), f"qk_split: a warp's "
                            f"{QK_ROW_GROUPS} x {QK_KEY_GROUPS} lanes land on the thread patches: "
                            f"the row groups ({row_groups(k)}) a multiple of {QK_ROW_GROUPS}, a "
                            f"row's lanes ({row_lanes(k)}) of {QK_KEY_GROUPS}")
        if k.qk_split * k.tile_rows > swizzle_stride(k):
            raise ctx.error(where, f"qk_split = {k.qk_split}: the warps' partial scores "
                            f"({k.qk_split} x {k.tile_rows} x {k.tile_keys} floats) must fit in "
                            f"the K tile they replace ({k.tile_keys} x {swizzle_stride(k)})")
        rows, keys = qk_patch(k)
        if accumulators(k) + rows * keys > TARGET.registers_per_thread:
            raise ctx.error(where, f"qk_split: a lane's {rows} x {keys} partial scores and "
                            f"{accumulators(k)} output floats in registers: "
                            f"{accumulators(k) + rows * keys}, and a thread has "
                            f"{TARGET.registers_per_thread}")

    def _check_key_split(self, k: Kernel, ctx: Ctx) -> None:
        """key_split = partials: the swizzled query tile (qtile_loads = swizzle) writes each
        row's (m, l, acc) for the decode combine."""
        from kgen.compiler.spec.contract import blame
        from kgen.ir.geometry import qtile_swizzle

        if not qtile_swizzle(k):
            raise ctx.error(blame(k, "key_split", "qtile_loads"), "key_split = partials splits "
                            "the swizzled query tile (qtile_loads = swizzle) only")

    def check_ring_floor(self, k: Kernel, ctx: Ctx) -> None:
        """The batch live floor exists only for fp16 window shadows read by a batched prefill."""
        from kgen.compiler.spec.contract import kv_said

        if k.ring_floor is RingFloor.BATCH:
            if not k.pair.shadows:
                raise ctx.error(k.where("ring_floor"), f"ring_floor = batch needs a format with "
                                f"an fp16 window ring; {kv_said(k)} has none")
            if k.mode is not Mode.PREFILL:
                raise ctx.error(k.where("ring_floor"), "ring_floor = batch needs mode = prefill "
                                "(the floor is derived from the batch's last row)")

    def check_dot_shape(self, k: Kernel, ctx: Ctx) -> None:
        """Dot lanes reduce by shuffles within a warp; a tile must fit one block."""
        from kgen.ir.geometry import query_tiles, tile_threads

        lanes = k.dot_lanes
        if lanes & (lanes - 1) or lanes > TARGET.warp:
            raise ctx.error(k.where("dot_lanes"), f"dot_lanes = {lanes}: the shuffle reduction "
                            f"needs a power of two no larger than the warp ({TARGET.warp})")
        if tile_threads(k) > TARGET.max_threads:
            raise ctx.error(k.where("tile_keys"), f"tile_keys * dot_lanes = {tile_threads(k)} "
                            f"threads exceeds a block ({TARGET.max_threads}); every key of a tile "
                            "needs its own dot lanes")
        if k.tile_keys & (k.tile_keys - 1):
            raise ctx.error(k.where("tile_keys"), f"tile_keys = {k.tile_keys} must be a power of "
                            "two (the split plan rounds split lengths with a mask)")
        if k.max_groups > TARGET.warp and not query_tiles(k):
            # A query tile packs (query, q head) rows: no fold or array of it is sized by the
            # group count, so its bound is the spec's alone.
            raise ctx.error(k.where("max_groups"), f"max_groups > {TARGET.warp}: the softmax fold "
                            "runs one thread per head inside the first warp")

    def check_register_k(self, k: Kernel, ctx: Ctx) -> None:
        """Register K: the chunk bound must cover the smallest legal head_dim, and a
        format's lane dequant may fix the lanes and the chunk multiple (e.g. 16 lanes
        onto a 32-element block, two chunks a block)."""
        from kgen.compiler.spec.contract import blame
        from kgen.ir.geometry import (
            max_head_dim_launched,
            min_head_dim,
            register_k_floats,
            stream_quads,
            streams,
        )

        if k.k_stage is not KStage.REGISTERS:
            return
        need = -(-min_head_dim(k) // k.dot_lanes)
        if k.kreg_max_chunk < need:
            raise ctx.error(k.where("kreg_max_chunk"), f"register K: kreg_max_chunk = "
                            f"{k.kreg_max_chunk} must be >= {need}, head_dim / dot_lanes at the "
                            f"smallest head_dim a block runs with ({min_head_dim(k)})")
        fmt = k.fmt
        # The format's lane dequant's layout (lane_dims = quads reads through its quad reader)
        lanes, multiple = ((None, 1) if stream_quads(k) else
                           (fmt.register_k_lanes, fmt.register_k_chunk_multiple))
        if lanes is not None and k.dot_lanes != lanes:
            raise ctx.error(k.where("dot_lanes"), f"register K over {fmt.name} needs dot_lanes = "
                            f"{lanes} (the format's lane dequant is laid out for it)")
        if k.kreg_max_chunk % multiple:
            raise ctx.error(k.where("kreg_max_chunk"), f"register K over {fmt.name} needs "
                            f"kreg_max_chunk a multiple of {multiple} (one scale serves that "
                            "many chunks)")
        widest = max_head_dim_launched(k)
        most = -(-widest // k.dot_lanes)
        most = -(-most // multiple) * multiple
        if k.kreg_max_chunk > most:
            raise ctx.error(k.where("kreg_max_chunk"), f"register K: kreg_max_chunk = "
                            f"{k.kreg_max_chunk} exceeds {most}, head_dim / dot_lanes at the "
                            f"widest head_dim a block runs with ({widest}: at most "
                            f"{TARGET.max_threads} threads)")
        floats = register_k_floats(k)
        if streams(k) and floats > TARGET.registers_per_thread:
            raise ctx.error(blame(k, "kreg_max_chunk", "max_groups", "keys_per_step"),
                            "register K: (max_groups + 2 * keys_per_step) * "
                            f"kreg_max_chunk = ({k.max_groups} + 2 * {k.keys_per_step}) * "
                            f"{k.kreg_max_chunk} = {floats} floats a warp_stream thread keeps in "
                            f"registers (its accumulators and the K and V chunks in flight); a "
                            f"thread has {TARGET.registers_per_thread}")

    def check_shared_v(self, k: Kernel, ctx: Ctx) -> None:
        """The shared-V tile stages raw rows at head_dim = tile_keys * dot_lanes as
        whole 32-bit words, in exactly v_rounds blockDim-strided rounds."""
        from kgen.ir.geometry import tile_threads

        if k.v_stage is not VStage.SHARED_Q4:
            return
        fmt = k.v_fmt  # the V rows' format stages its raw rows
        if not fmt.raw_v_tile:
            said = "v_kv" if k.mixed else "kv"
            raise ctx.error(k.where("v_stage"), f"v_stage = {k.v_stage.value}: {said} = "
                            f"{fmt.name} has no raw V tile reader")
        head_dim = tile_threads(k)
        if not fmt.accepts_head_dim(head_dim):
            raise ctx.error(k.where("tile_keys"), f"shared-V pins head_dim = tile_keys * "
                            f"dot_lanes = {head_dim}, not a whole number of {fmt.name} blocks")
        row_bytes = fmt.row_bytes(head_dim)
        tile_bytes = k.tile_keys * row_bytes
        if tile_bytes % 4:
            raise ctx.error(k.where("v_stage"), f"the shared-V tile ({tile_bytes} bytes) is not "
                            "a whole number of 32-bit words")
        rounds = -(-(tile_bytes // 4) // head_dim)
        if rounds != k.v_rounds:
            raise ctx.error(k.where("v_rounds"), f"v_rounds = {k.v_rounds}, but the shared-V tile "
                            f"({tile_bytes // 4} words) stages in {rounds} rounds of {head_dim} "
                            f"threads at head_dim {head_dim}")

    def check_shared_budget(self, k: Kernel, ctx: Ctx) -> None:
        """At least the smallest legal launch (one group, the smallest head_dim) must fit
        the shared memory a block may use; a query_tile kernel, whose shared memory does
        not depend on the groups, at every head_dim it accepts (up to max_head_dim)."""
        from kgen.ir.geometry import flash_shared_bytes, min_head_dim, query_tiles

        hd = k.max_head_dim if query_tiles(k) else min_head_dim(k)  # query_tile: its widest
        need = flash_shared_bytes(k, 1, hd)
        limit = TARGET.shared_per_block
        if need > limit:
            raise ctx.error(k.pos, f"needs {need} bytes of shared memory at kv_groups = 1, "
                            f"head_dim = {hd}; a block may use {limit}")

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        fmt = k.pair  # the cache's formats: shadows and scales of the roles that keep them
        shadows = [s.name for s in fmt.shadow_buffers()]
        shadow_scalars = list(fmt.shadow_scalars())
        scales = list(fmt.scale_scalars())
        out = fixed("const float *", "q")
        out += cache_arrays(k, "const ")
        out += fixed("const __half *", *shadows)
        if k.mode is Mode.PREFILL:
            out += fixed("float *", *(("m_out", "l_out", "acc_out")
                                      if k.key_split is KeySplit.PARTIALS else ("out",)))
            if k.sinks is Sinks.LEARNED:
                out += fixed("const float *", "sinks")
        else:
            out += fixed("float *", "m_out", "l_out", "acc_out")
        if k.position is Position.PAGED:
            out += fixed("const int *", "block_table", "seq_lens")
            if k.mode is Mode.PREFILL:
                out += fixed("const int *", "query_start_loc")
            out += fixed("int", "kv_groups", "head_dim", "block_size", "max_blocks")
            out += fixed("int", "num_reqs") if k.mode is Mode.PREFILL else \
                fixed("int", "kps", "splits_cap")
            if k.key_split is KeySplit.PARTIALS:
                out += fixed("int", "n_splits")
        elif k.mode is Mode.PREFILL:
            out += fixed("int", "kv_groups", "head_dim", "max_seq")
            out += fixed("int", "pos0")
            if k.rows_per_block > 1 or k.schedule is Schedule.QUERY_TILE:
                out += fixed("int", "n_rows")
            if k.key_split is KeySplit.PARTIALS:
                out += fixed("int", "n_splits")
        else:
            out += fixed("int", "kv_groups", "head_dim", "max_seq")
            out += position_params(k, fixed("int", "seq_len", "n_splits", "split_len"))
            if k.position is not Position.HOST:
                out += fixed("int", "kps", "splits_cap")
        out += fixed("int", *shadow_scalars)
        out += fixed("float", *scales)
        if k.window is Window.EXACT:
            out += fixed("int", "attn_sink", "win_left", "win_right")
        else:
            out += fixed("int", "attn_sink", "attn_win")
        out += fixed("float", "scale")
        if k.softcap is SoftCap.TANH:
            out += fixed("float", "softcap")
        return out

    def host_bounds(self, k: Kernel) -> list[PyArg]:
        if k.mode is Mode.DECODE and k.position is Position.SLOTS:
            return [PyArg("launch_splits", "int | None", "None")]
        if k.mode is Mode.DECODE and k.position is Position.PAGED:
            return [PyArg("max_seq_len", "int | None", "None")]  # host bound: the grid
        if k.mode is Mode.PREFILL and k.position is Position.PAGED:
            return [PyArg("max_query_len", "int | None", "None")]  # host bound: the grid
        return []

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = Flash()
