"""The op ``flash``: tiled online-softmax attention over the KV cache: prefill and split decode."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

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
from kgen.ir.geometry import cache_load_bytes
from kgen.ir.params import INT_MAX
from kgen.ir.pyapi import PyArg
from kgen.ir.signature import cache_arrays, fixed, position_params
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef, PublicCall

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker


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
        out += cache_arrays(k, "const ", lambda role: cache_load_bytes(k, role))
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
    listed = ("=mode", "position:pos", "kv", "q_stage:q", "k_stage:k", "v_stage:v")  # kgen list
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
    sets_combine_tile = True  # a cache's combine plans with the split decode's tile_keys
    sinks_keyword = True      # learned sinks come as the sinks keyword (Options.kwargs)
    entries = ("paged_attention",)  # kgen.runtime's public calls
    # a new output in query's dtype (the call's out= is float32 only)
    public_calls = (PublicCall("paged_attention", result="query", leaves=("out",)),)

    def bind(self, k: Kernel, c: Checker, a: dict):
        """A prefill or split decode over a contiguous cache (host, device or per-slot
        position) or over pages (position = paged: :meth:`_bind_paged`)."""
        if k.position is Position.PAGED:
            return self._bind_paged(k, c, a)
        return self._bind_contiguous(k, c, a)

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        self._bind_head_dim(k, c, hd)
        self._bind_groups(k, c, groups, hd)

    def rank(self, k: Kernel, options: int) -> tuple:
        """Exact staging before fp16 q or K tiles, then a query_tile prefill with scalar
        or swizzled loads (the forms the contiguous and paged prefills share; make
        bench-kernels, prefill_long and paged_goals, time them), the swizzled one first
        (2.3x the scalar one's speed at head_dim 128, 8k causal rows on the H200), then
        the fewest options nobody asked for, then a hoisted warp_stream decode (one
        head_dim, its bounds set to the shape: 1.4-4.2x the tiled decode's speed, each at
        its best plan, at 4k and 32k keys on the H200; make bench-kernels, decode_goals),
        its quads form first (lanes own float4s of dims, loads a step ahead: 1.1-1.45x
        the strided form at 32k keys), with the tightest group bound, then the query tile
        with the tightest head_dim bound (the most rows and keys a tile for the head
        size), then the tiled schedule (a guarded warp_stream decode or a vec4 query tile
        is chosen by `kgen tune` or by name), then the widest tile (the most of the block
        scoring keys: fewer tile steps), then a block with no idle threads. The dense,
        per-slot and paged forms rank alike, so one shape gets the same arithmetic in
        each (the paged form bit for bit the dense)."""
        from kgen.ir.geometry import (
            padded,
            qtile_swizzle,
            qtile_vec4,
            query_tiles,
            stream_hoisted,
            stream_quads,
            tile_threads,
        )

        lossy = k.q_stage is QStage.F16 or k.k_stage is KStage.SHARED_F16
        fast = k.mode is Mode.DECODE and stream_hoisted(k)
        rows = query_tiles(k) and not qtile_vec4(k)  # a query tile, dense or paged
        return (lossy, not rows, not qtile_swizzle(k), options, not fast,
                fast and not stream_quads(k), k.max_groups if fast else 0,
                k.max_head_dim if rows else 0, k.schedule is not Schedule.BLOCK_TILE,
                -tile_threads(k), padded(k))

    def _bind_head_dim(self, k: Kernel, c: Checker, hd: int) -> None:
        """The block is head_dim threads (or that in whole warps); every tile key is
        scored by its own dot lanes. A query_tile block is fixed by its tile shape and
        takes any head_dim its threads' output patches cover. (The block's resources are
        _bind_groups'.)"""
        from kgen.ir.geometry import (
            block_threads,
            head_dim_step,
            out_cols,
            padded,
            query_tiles,
            row_lanes,
            stream_head_dim,
            stream_hoisted,
            tile_threads,
        )
        from kgen.runtime.checks import check_head_dim

        if query_tiles(k):
            c.require(1 <= hd <= k.max_head_dim, "head_dim range",
                      lambda: f"head_dim = {hd}: each thread holds its rows' outputs for head_dim "
                      f"up to max_head_dim = {k.max_head_dim} (in {out_cols(k)} columns of "
                      f"{row_lanes(k)} lanes a row)")
            fmt, step = k.pair, head_dim_step(k)
            if step == fmt.block:
                c.require(fmt.accepts_head_dim(hd), "row format",
                          lambda: f"head_dim = {hd} must be a multiple of {fmt.block} (whole "
                          f"{fmt.name} blocks)")
            else:  # float4 reads along head_dim
                c.require(hd >= step and hd % step == 0, "row format",
                          lambda: f"head_dim = {hd} must be a multiple of {step} (whole {fmt.name} "
                          "blocks, read as float4s)")
            return
        threads = block_threads(k, hd)
        c.require(TARGET.fits_block(threads), "block size",
                  lambda: f"head_dim = {hd}: a block is {threads} threads, at most "
                  f"{TARGET.max_threads}")
        check_head_dim(k, c, hd, rows=True)
        if padded(k):
            c.require(hd % k.dot_lanes == 0, "dot chunks",
                      lambda: f"head_dim = {hd}: each of the {k.dot_lanes} dot lanes takes "
                      f"whole chunks (head_dim % {k.dot_lanes} == 0)")
        else:
            c.require(hd % TARGET.warp == 0, "whole warps",
                      lambda: f"head_dim = {hd}: the dot shuffles use full-warp masks, so a "
                      f"block must be whole warps (head_dim % {TARGET.warp} == 0; threads = warps "
                      "pads it)")
        tt = tile_threads(k)
        c.require(threads >= tt, "every key scored",
                  lambda: f"head_dim = {hd}: {threads} threads < tile_keys * dot_lanes = {tt}: "
                  f"thread ky = tid / {k.dot_lanes} scores key ky, so keys "
                  f"{threads // k.dot_lanes}.."
                  f"{k.tile_keys - 1} of each tile would keep stale scores")
        if stream_hoisted(k):
            c.require(hd == stream_head_dim(k), "hoisted chunk",
                      lambda: f"head_dim = {hd}: stream_loads = hoisted fixes each lane's chunk at "
                      f"kreg_max_chunk = {k.kreg_max_chunk}, so head_dim = {stream_head_dim(k)}")
        if k.k_stage is KStage.REGISTERS:
            c.require(hd <= k.kreg_max_chunk * k.dot_lanes, "register K chunk",
                      lambda: f"head_dim = {hd} > kreg_max_chunk * dot_lanes = "
                      f"{k.kreg_max_chunk * k.dot_lanes}: K would not fit the register chunk")
        if k.v_stage is VStage.SHARED_Q4:
            c.require(hd == tt, "shared-V shape",
                      lambda: f"the shared-V tile is sized for head_dim = {tt}, not {hd}")

    def _bind_scalars(self, k: Kernel, c: Checker, a: dict, values: dict, hd: int) -> None:
        """The window (tile-granular or key-exact), the scale and the soft-cap a flash
        kernel takes, each in its range (and finite in float32)."""
        from kgen.runtime.checks import param

        values["attn_sink"] = param(c, a, "attn_sink")
        if k.window is Window.EXACT:
            values["win_left"] = param(c, a, "win_left")
            values["win_right"] = param(c, a, "win_right")
        else:
            values["attn_win"] = param(c, a, "attn_win")
        values["scale"] = param(c, a, "scale", 1.0 / math.sqrt(hd))
        if k.softcap is SoftCap.TANH:
            values["softcap"] = param(c, a, "softcap")

    def _bind_groups(self, k: Kernel, c: Checker, G: int, hd: int) -> int:
        """kv_groups within the compile-time bound, and the block's resources fit the
        target: the shared memory it needs (returns that many bytes), then its
        registers (checked last: a shape an axis contract refuses is refused as such)."""
        from kgen.ir.geometry import block_threads, flash_shared_bytes
        from kgen.runtime.checks import block_registers

        c.require(1 <= G <= k.max_groups, "kv_groups",
                  lambda: f"kv_groups = {G} exceeds the compile-time bound max_groups = "
                  f"{k.max_groups}")
        smem = flash_shared_bytes(k, G * k.rows_per_block, hd)  # a block stages every row's q
        limit = TARGET.shared_per_block
        c.require(smem <= limit, "shared memory",
                  lambda: f"needs {smem} bytes of shared memory (kv_groups {G}, head_dim "
                  f"{hd}); a block may use {limit}")
        block_registers(k, c, block_threads(k, hd), hd)
        return smem

    def _bind_prefill_out(self, k: Kernel, c: Checker, a: dict, values: dict, rows: int,
                          n_head: int, hd: int) -> int:
        """A prefill's outputs, checked into ``values``: out [rows][n_head][head_dim], or
        (key_split = partials) the (m, l, acc) partials of rows * n_head combine heads x
        n_splits (acc x head_dim); returns the split count (1: the whole form)."""
        from kgen.ir.geometry import key_partials
        from kgen.runtime.checks import PARTIALS_OUT, partials

        if not key_partials(k):
            c.array("out", a["out"], np.float32, 3)
            c.shape("out", a["out"], (rows, n_head, hd))
            values["out"] = a["out"]
            return 1
        splits = c.integer("n_splits", a["n_splits"], 1)
        partials(c, a, PARTIALS_OUT, rows * n_head, splits, hd, detail=True)
        values.update(m_out=a["m_out"], l_out=a["l_out"], acc_out=a["acc_out"], n_splits=splits)
        return splits

    def _bind_contiguous(self, k: Kernel, c: Checker, a: dict):
        """The cache [n_head_kv][max_seq][row] (per slot: [nslots][...]); positions from
        the host (prefill, or a decode's split plan) or the device (kps, splits_cap)."""
        from kgen.ir.geometry import block_threads, prefill_grid, query_tiles
        from kgen.runtime.checks import (
            PARTIALS_OUT,
            cache_arrays,
            cache_values,
            device_positions,
            learned_sinks,
            partials,
        )
        from kgen.runtime.plan import decode_plan

        prefill = k.mode is Mode.PREFILL
        slots = k.position is Position.SLOTS
        q = a["q"]
        c.array("q", q, np.float32, 3 if (prefill or slots) else 2)
        hd = int(q.shape[-1])
        n_head = int(q.shape[-2])
        lead_q = tuple(int(x) for x in q.shape[:-2])  # (n,) prefill, (nslots,) slots, () decode
        kc = a["k_cache"]
        c.require(hasattr(kc, "shape") and kc.ndim >= 3, "shape",
                  "k_cache must be [n_head_kv][max_seq][row] (per slot: [nslots][...])")
        n_head_kv = int(kc.shape[-3])
        lead = (lead_q[0], n_head_kv) if slots else (n_head_kv,)

        self._bind_head_dim(k, c, hd)
        c.require(n_head_kv >= 1 and n_head % n_head_kv == 0, "GQA",
                  lambda: f"n_head = {n_head} is not a multiple of n_head_kv = {n_head_kv}")
        G = n_head // n_head_kv
        smem = self._bind_groups(k, c, G, hd)

        max_seq = cache_arrays(k, c, a, lead, hd)
        values = dict(q=q, kv_groups=G, head_dim=hd, max_seq=max_seq)
        cache_values(k, c, a, values)
        self._bind_scalars(k, c, a, values, hd)
        if k.sinks is Sinks.LEARNED:
            values["sinks"] = learned_sinks(c, a, (lead_q[0] if slots and not prefill else 1)
                                            * n_head)

        if prefill:
            n = lead_q[0]
            splits = self._bind_prefill_out(k, c, a, values, n, n_head, hd)
            pos0 = c.integer("pos0", a["pos0"], 0)
            c.require(pos0 + n <= max_seq, "no ring wrap",
                      lambda: f"query rows read cache rows [0, pos0 + n) = [0, {pos0 + n}) without "
                      f"wrapping; max_seq = {max_seq}")
            values.update(pos0=pos0)
            if k.rows_per_block > 1 or query_tiles(k):
                values["n_rows"] = n
            if query_tiles(k):  # rows (query, q head) of a kv head, and a tile past them, in int
                c.require(n * G <= INT_MAX - k.tile_rows, "int32 index",
                          lambda: f"{n} query rows x {G} q heads overflow the kernel's int "
                          "row index")
            return (prefill_grid(k, n, G, n_head_kv, splits), (block_threads(k, hd), 1, 1), smem,
                    values)

        heads = (lead_q[0] if slots else 1) * n_head
        if k.position is Position.HOST:
            seq_len = c.integer("seq_len", a["seq_len"], 1, max_seq, "no ring wrap")
            n_splits = c.integer("n_splits", a["n_splits"], 1)
            split_len = c.integer("split_len", a["split_len"], 1)
            c.require(split_len % k.tile_keys == 0, "split plan",
                      lambda: f"split_len = {split_len} must be whole tiles of {k.tile_keys}")
            c.require(n_splits == -(-seq_len // split_len), "split plan",
                      lambda: f"n_splits = {n_splits} does not cover seq_len = {seq_len} in "
                      f"splits of {split_len} (expected {-(-seq_len // split_len)})")
            width = n_splits
            grid = (n_splits, n_head_kv, 1)
            values.update(seq_len=seq_len, n_splits=n_splits, split_len=split_len)
        else:
            kps = c.integer("kps", a["kps"], 1)
            cap = c.integer("splits_cap", a["splits_cap"], 1)
            values.update(kps=kps, splits_cap=cap, pos=a["pos"])
            count = lead_q[0] if slots else 1
            host = device_positions(k, c, a, count, max_seq, rows=1, wrap=False)
            width = cap
            if slots:
                width = a.get("launch_splits") or cap
                width = c.integer("launch_splits", width, 1)
                if host is not None:
                    need = max(decode_plan(int(p) + 1, kps, cap, k.tile_keys).n_splits
                               for p in host)
                    c.require(width >= need, "slot plan coverage",
                              lambda: f"launch_splits = {width} < {need}, the longest slot's "
                              "plan: its later splits would never be computed")
                grid = (width, n_head_kv, lead_q[0])
            else:
                grid = (cap, n_head_kv, 1)
                if host is not None:  # partials are strided by the live plan's n_splits
                    width = decode_plan(int(host[0]) + 1, kps, cap, k.tile_keys).n_splits
        # Partials are strided by the live split count; size them for the widest.
        partials(c, a, PARTIALS_OUT, heads, width, hd, detail=True)
        values.update(m_out=a["m_out"], l_out=a["l_out"], acc_out=a["acc_out"])
        return grid, (block_threads(k, hd), 1, 1), smem, values

    def _bind_tables(self, k: Kernel, c: Checker, a: dict, nb: int, bs: int, reqs: int) -> int:
        """block_table [num_reqs][max_blocks] and seq_lens [num_reqs]; returns max_blocks."""
        from kgen.runtime.checks import host_ints, index

        bt = a["block_table"]
        c.array("block_table", bt, np.int32, 2)
        c.require(int(bt.shape[0]) == reqs, "shape", lambda: f"block_table has {bt.shape[0]} "
                  f"rows for {reqs} requests")
        mb = int(bt.shape[1])
        c.require(mb >= 1, "shape", "block_table has no columns")
        index(c, a, "seq_lens", (reqs,))
        if a.get("validate_pos", True):
            lens = host_ints(a["seq_lens"])
            table = host_ints(bt)
            c.require(bool((lens >= 1).all()), "seq_lens", lambda: f"seq_lens must be >= 1, "
                      f"got {lens.min()}")
            c.require(bool((lens <= mb * bs).all()), "seq_lens", lambda: f"a sequence of "
                      f"{lens.max()} keys needs more than the table's {mb} blocks of {bs}")
            for r, n in enumerate(lens):
                used = table[r, : -(-int(n) // bs)]
                c.require(bool(((used >= 0) & (used < nb)).all()), "block_table",
                          lambda r=r: f"request {r} maps a block outside [0, {nb})")
        return mb

    def _bind_paged(self, k: Kernel, c: Checker, a: dict):
        """Pages [num_blocks][block_size][n_head_kv][row] through each request's block-table
        row: a varlen prefill (query_start_loc) or a decode of one row per request."""
        from kgen.ir.geometry import block_threads, paged_prefill_grid, query_tiles
        from kgen.runtime.checks import (
            PARTIALS_OUT,
            cache_values,
            host_ints,
            learned_sinks,
            pages,
            partials,
        )

        prefill = k.mode is Mode.PREFILL
        q = a["q"]
        c.array("q", q, np.float32, 3)
        rows, n_head, hd = (int(x) for x in q.shape)
        self._bind_head_dim(k, c, hd)
        nb, bs, hk = pages(k, c, a, hd)
        c.require(n_head % hk == 0, "GQA", lambda: f"n_head = {n_head} is not a multiple of "
                  f"n_head_kv = {hk}")
        G = n_head // hk
        smem = self._bind_groups(k, c, G, hd)
        values = dict(q=q, k_cache=a["k_cache"], v_cache=a["v_cache"], kv_groups=G, head_dim=hd,
                      block_size=bs)
        cache_values(k, c, a, values)
        self._bind_scalars(k, c, a, values, hd)
        if prefill:
            qsl = a["query_start_loc"]
            c.array("query_start_loc", qsl, np.int32, 1)
            reqs = int(qsl.shape[0]) - 1
            c.require(reqs >= 1, "shape", "query_start_loc needs num_reqs + 1 entries")
            mb = self._bind_tables(k, c, a, nb, bs, reqs)
            qlen = None
            if a.get("validate_pos", True):
                starts, lens = host_ints(qsl), host_ints(a["seq_lens"])
                qlen = np.diff(starts)
                c.require(int(starts[0]) == 0 and int(starts[-1]) == rows and
                          bool((qlen >= 0).all()), "query_start_loc",
                          lambda: f"query_start_loc must rise from 0 to the {rows} rows of q")
                c.require(bool((qlen <= lens).all()), "query_start_loc",
                          "a request has more query rows than keys (seq_lens)")
            splits = self._bind_prefill_out(k, c, a, values, rows, n_head, hd)
            if k.sinks is Sinks.LEARNED:
                values["sinks"] = learned_sinks(c, a, n_head)
            values.update(block_table=a["block_table"], seq_lens=a["seq_lens"],
                          query_start_loc=qsl, max_blocks=mb, num_reqs=reqs)
            c.require(rows >= 1, "shape", "no query rows")
            # The host's bound on one request's query rows (the grid of a query_tile form).
            mq = c.integer("max_query_len", a.get("max_query_len") or rows, 1, rows,
                           "max_query_len")
            if qlen is not None:
                most = int(qlen.max())
                c.require(most <= mq, "max_query_len", lambda: f"a request has {most} query "
                          f"rows, above max_query_len = {mq}")
            if query_tiles(k):  # rows (query, q head) of a kv head, and a tile past them, in int
                c.require(mq * G <= INT_MAX - k.tile_rows, "int32 index",
                          lambda: f"{mq} query rows x {G} q heads overflow the kernel's int row "
                          "index")
            return (paged_prefill_grid(k, rows, mq, G, hk, reqs, splits),
                    (block_threads(k, hd), 1, 1), smem, values)
        reqs = rows
        mb = self._bind_tables(k, c, a, nb, bs, reqs)
        kps = c.integer("kps", a["kps"], 1)
        cap = c.integer("splits_cap", a["splits_cap"], 1)
        bound = c.integer("max_seq_len", a.get("max_seq_len") or mb * bs, 1, mb * bs,
                          "max_seq_len")
        if a.get("validate_pos", True):
            lens = host_ints(a["seq_lens"])
            c.require(int(lens.max()) <= bound, "max_seq_len", lambda: f"a request has "
                      f"{int(lens.max())} keys, above max_seq_len = {bound}")
        # Every request's plan has at most min(ceil(bound / kps), cap) splits: the width.
        width = min(max(-(-bound // kps), 1), cap)
        heads = reqs * n_head
        partials(c, a, PARTIALS_OUT, heads, width, hd)
        values.update(m_out=a["m_out"], l_out=a["l_out"], acc_out=a["acc_out"],
                      block_table=a["block_table"], seq_lens=a["seq_lens"], max_blocks=mb,
                      kps=kps, splits_cap=cap)
        return (width, hk, reqs), (block_threads(k, hd), 1, 1), smem, values

    # --- C++ view
    def cpp_view(self, k, hd, groups, rows) -> dict:
        # the geometry as the Python functions compute it (symbolic arguments)
        from kgen.ir import geometry as geo

        tiles = geo.query_tiles(k)
        return super().cpp_view(k, hd, groups, rows) | {
            "query_tiles": tiles, "padded": geo.padded(k), "hoisted": geo.stream_hoisted(k),
            "key_partials": geo.key_partials(k),
            "stream_head_dim": geo.stream_head_dim(k) if geo.streams(k) else 0,
            "tile_threads": geo.tile_threads(k),
            "out_cols": geo.out_cols(k) if tiles else 0,
            "row_lanes": geo.row_lanes(k) if tiles else 0,
            "head_dim_step": geo.head_dim_step(k) if tiles else 0,
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

    def call_args(self, call: str, k, case, alloc) -> dict | None:
        """paged_attention over a paged kernel's case, as an engine steps it: its pages,
        block table and lengths; each request's rows the last of its keys (one a request in
        a decode), slotted through its table; the pages in the kernel's one format."""
        from kgen.ir.axes import Mode, Position

        if k.position is not Position.PAGED or k.mixed or not case.requests:
            return None
        a = self.contract_args(k, case, alloc)
        bs, table = case.block_size, a["block_table"]
        rows = [1 if k.mode is Mode.DECODE else q for q, _ in case.requests]
        keys = [kk for _, kk in case.requests]
        slots = [int(table[r, p // bs]) * bs + p % bs
                 for r, (n, kk) in enumerate(zip(rows, keys, strict=True))
                 for p in range(kk - n, kk)]
        return dict(query=a["q"], key_cache=a["k_cache"], value_cache=a["v_cache"],
                    query_start_loc=np.concatenate([[0], np.cumsum(rows)]).astype(np.int32),
                    seq_lens=a["seq_lens"], block_table=table,
                    slot_mapping=np.array(slots, np.int32), max_query_len=max(rows),
                    max_seq_len=max(keys), kv_cache_dtype=k.kv.value,
                    **{n: a[n] for n in ("k_scale", "v_scale") if n in a})

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
            return shapes.PAGED_PREFILL + (
                shapes.paged_query_tile_cases(k, self.shape_refusal) if query_tiles(k) else [])
        if k.mode is Mode.PREFILL:
            return shapes.PREFILL + (
                shapes.query_tile_cases(k, self.shape_refusal) if query_tiles(k) else [])
        return shapes.DECODE_SLOTS if k.position is Position.SLOTS else shapes.DECODE

    def case_required(self, k) -> list:
        from kgen.testing.shapes import flash_case, flash_shapes, option_cases

        out = [flash_case(k, hd, groups, f"hd{hd}_g{groups}_partial_tile")
               for hd, groups in flash_shapes(k, self.shape_refusal)]
        return out + option_cases(k, out[-1] if len(out) < 3 else out[1])

    def case_smallest_head_dim(self, k) -> int:
        from kgen.ir.geometry import min_head_dim

        return min_head_dim(k)

    def case_registers_bound(self, k) -> bool:
        from kgen.ir.geometry import query_tiles

        return not query_tiles(k)

    def gpu_check(self, k, fn, case, find) -> None:
        from kgen.ir.axes import Position
        from kgen.testing import gpu, paged

        if k.position is Position.PAGED:
            return paged.check_attention(k, fn, case)
        return gpu.check_flash(k, fn, case)


OP = Flash()
