"""The op ``flash``: tiled online-softmax attention over the KV cache: prefill and split decode."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from kgen.ir.axes import (
    KStage,
    Mode,
    Op,
    Position,
    QStage,
    Schedule,
    Sinks,
    SoftCap,
    VStage,
    Window,
)
from kgen.ir.params import INT_MAX
from kgen.ir.target import TARGET
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.runtime.contracts import Checker


class Flash(OpDef):
    op = Op.FLASH

    # --- spec: axes and checks
    cache = True
    planned = True

    # --- signature and geometry

    # --- render

    # --- binding and launch
    sets_combine_tile = True  # a cache's combine plans with the split decode's tile_keys
    sinks_keyword = True      # learned sinks come as the sinks keyword (Options.kwargs)
    entries = ("paged_attention",)  # kgen.runtime's public calls

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

    # --- contracts, reference and test cases


OP = Flash()
