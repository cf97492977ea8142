"""What shapes each kernel accepts, computed from its axes with the launch
contracts themselves (kgen.runtime.bind.shape_refusal), so a tool can see
coverage without a GPU: `kgen list --json`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kgen import ops
from kgen.ir.axes import MLA_OPS, KStage, Op, VStage
from kgen.ir.geometry import (
    block_threads,
    combine_threads,
    dense_threads,
    dflash_threads,
    flash_shared_bytes,
    head_dim_step,
    merge_threads,
    query_tiles,
    tile_threads,
)
from kgen.ir.kernel import Kernel
from kgen.ir.target import TARGET
from kgen.runtime.bind import QZ_BLOCK, shape_refusal
from kgen.runtime.record import Built
from kgen.toolchain.resources import Resources


def head_dims(k: Kernel) -> list[int]:
    """Every head_dim (up to a block's thread limit) ``k`` launches with one group."""
    if k.op is Op.QZ_SPLIT:
        return []
    return [hd for hd in range(1, TARGET.max_threads + 1) if shape_refusal(k, hd, 1) is None]


def groups_by_head_dim(k: Kernel, dims: list[int]) -> dict[int, int]:
    """The largest kv_groups each head_dim fits (flash kernels; shared memory bounds it)."""
    out = {}
    for hd in dims:
        g = k.max_groups
        while g > 1 and shape_refusal(k, hd, g) is not None:
            g -= 1
        out[hd] = g
    return out


def runs(values: list[int]) -> str:
    """``64..512/32``-style summary of an arithmetic run, else the list."""
    if not values:
        return "-"
    if len(values) == 1:
        return str(values[0])
    step = values[1] - values[0]
    if all(b - a == step for a, b in zip(values, values[1:], strict=False)):
        return f"{values[0]}..{values[-1]}" + (f"/{step}" if step != 1 else "")
    return ",".join(map(str, values))


OCCUPANCY_HEAD_DIMS = (64, 128, 256, 512)  # the sizes `kgen list --json` reports occupancy at


def occupancy(k: Kernel, resources: dict, dims: list[int], groups: int | None = None) -> dict:
    """sm_37 occupancy of a flash or decode-combine kernel at the head sizes it serves
    among OCCUPANCY_HEAD_DIMS and at the widest it serves where that lies short of the
    largest listed size (a spec's own size, such as 96 or 192, where its shared memory
    peaks; the smallest it serves if that leaves none; every one of ``dims`` when
    ``groups`` is given), a flash kernel's at the most groups it allows (or at
    ``groups``, a launch's): threads, shared bytes, and blocks and warps resident per
    multiprocessor, from ptxas's registers and static shared memory and the launch
    geometry."""
    out = {}
    widest = [d for d in dims[-1:] if d < OCCUPANCY_HEAD_DIMS[-1]]
    wanted = dims if groups is not None else sorted(
        {d for d in OCCUPANCY_HEAD_DIMS if d in dims} | set(widest)) or dims[:1]
    for hd in wanted:
        shared = resources.get("static_smem", 0)
        if k.op is Op.FLASH:
            g = groups if groups is not None else groups_by_head_dim(k, [hd])[hd]
            threads = block_threads(k, hd)
            shared += flash_shared_bytes(k, g, hd)
            row = {"groups": g}
        else:  # decode_combine: no dynamic shared memory
            threads, row = combine_threads(k, hd), {}
        blocks, warps = TARGET.occupancy(threads, resources["registers"], shared)
        out[str(hd)] = row | {"threads": threads, "shared_bytes": shared,
                              "blocks_per_sm": blocks, "warps_per_sm": warps}
    return out


def limits(k: Kernel, resources: dict | None = None) -> dict:
    """The shape limits of one kernel, as data; with ptxas's ``resources`` for it, its
    registers, stack frame and sm_37 occupancy too, and the head_dims its registers
    leave it (the launch contract ``block registers`` weighs them)."""
    if resources is not None and resources.get("registers") is not None:
        k = Built(**{f.name: getattr(k, f.name) for f in fields(Kernel)},
                  registers=int(resources["registers"]))
    dims = head_dims(k)
    out: dict = {"head_dims": dims}
    if k.op is Op.FLASH:
        out["max_groups"] = k.max_groups
        out["groups_by_head_dim"] = groups_by_head_dim(k, dims)
        out["tile_keys"] = k.tile_keys
        out["dot_lanes"] = k.dot_lanes
    if k.op in (Op.FLASH, Op.KV_APPEND) and k.pair.shadows:
        out["sink_rows"], out["ring_rows"] = k.sink_rows, k.ring_rows
    if resources is not None:
        sm = {"registers": resources["registers"], "stack_frame": resources["stack_frame"],
              "spill_stores": resources["spill_stores"]}
        if k.op in (Op.FLASH, Op.DECODE_COMBINE) and dims:
            sm["occupancy"] = occupancy(k, resources, dims)
        out["sm_37"] = sm
    return out


# -- does one block fit the target, with ptxas's registers and static shared memory ------

def sized_head_dim(k: Kernel) -> int | None:
    """The widest head_dim a kernel's own axes size it for: register K's chunk
    (kreg_max_chunk * dot_lanes), a query_tile thread's output patch (max_head_dim),
    the shared-V tile (tile_keys * dot_lanes), an append's static staging
    (max_head_dim); None where only the target's block limit bounds its head_dim."""
    if k.op is Op.FLASH:
        if query_tiles(k):
            return k.max_head_dim
        if k.v_stage is VStage.SHARED_Q4:
            return tile_threads(k)
        if k.k_stage is KStage.REGISTERS:
            return k.kreg_max_chunk * k.dot_lanes
    if k.op is Op.KV_APPEND and k.pair.append_staging:
        return k.max_head_dim
    if k.op in (Op.DFLASH_ATTENTION, Op.DENSE_ATTENTION):  # a warp's q and output rows,
        return k.max_head_dim                                 # in registers
    return None


@dataclass(frozen=True)
class Block:
    """One launch's block: the head_dim and kv_groups it was taken at (None: the
    launch has none), its threads and its shared memory (static and dynamic)."""

    head_dim: int | None
    groups: int | None
    threads: int
    shared: int

    def at(self) -> str:
        said = [f"{n} {v}" for n, v in (("head_dim", self.head_dim), ("kv_groups", self.groups))
                if v is not None]
        return f" at {', '.join(said)}" if said else ""


def _served(k: Kernel, bound: int | None) -> list[int]:
    """The head_dims ``block_misfit`` weighs, of those ``k`` serves (``head_dims``): all
    of a tiled or streamed flash kernel's (asked only at the multiples of its head_dim
    step, the only sizes it runs with: its shared memory varies with head_dim and
    groups); else the smallest, the widest up to ``bound`` and the widest (the rest
    lie between: a query_tile block is fixed and its shared memory grows with
    head_dim; an append or combine block is head_dim threads, its shared memory
    static)."""
    if k.op is Op.FLASH and not query_tiles(k):
        step = head_dim_step(k)
        return [hd for hd in range(step, TARGET.max_threads + 1, step)
                if shape_refusal(k, hd, 1) is None]
    if k.op is Op.QZ_SPLIT:
        return []

    def first(dims: range) -> list[int]:
        return next(([hd] for hd in dims if shape_refusal(k, hd, 1) is None), [])

    top = TARGET.max_threads
    ends = first(range(1, top + 1)) + first(range(top, 0, -1))
    if bound is not None:
        ends += first(range(min(bound, top), 0, -1))
    return sorted(set(ends))


def _block(k: Kernel, hd: int | None, static: int) -> Block:
    if k.op is Op.QZ_SPLIT or hd is None:
        return Block(None, None, QZ_BLOCK if k.op is Op.QZ_SPLIT else 1, static)
    if k.op is Op.MERGE_ATTN_STATES:  # a fixed block of warps, a warp per row
        return Block(hd, None, merge_threads(), static)
    if k.op in MLA_OPS:  # a fixed block per op, all its shared memory static
        return Block(hd, None, ops.get(k.op).mla_threads(k), static)
    if k.op is Op.DFLASH_ATTENTION:  # likewise, whatever head_dim
        return Block(hd, None, dflash_threads(), static)
    if k.op is Op.DENSE_ATTENTION:  # likewise; its tiles are static shared memory
        return Block(hd, None, dense_threads(), static)
    if k.op is not Op.FLASH:  # an append or combine block is head_dim threads
        return Block(hd, None, hd, static)
    g = groups_by_head_dim(k, [hd])[hd]
    return Block(hd, g, block_threads(k, hd),
                 static + flash_shared_bytes(k, g * k.rows_per_block, hd))


def block_misfit(k: Kernel, res: Resources) -> str | None:
    """Why a block of ``k`` cannot launch on the target, with ptxas's registers and
    static shared memory (None when it fits): its threads and registers a block (the
    allocation per warp that occupancy counts) at the widest launch its axes size it
    for (its smallest launch where the target alone bounds its head_dim), and its
    shared memory, static and dynamic, at the launch that needs the most."""
    bound = sized_head_dim(k)
    dims = _served(k, bound)
    if k.op is not Op.QZ_SPLIT and not dims:
        return None  # no launch (the launch contracts refuse every head_dim)
    sized = [d for d in dims if bound is None or d <= bound]
    wide = _block(k, (max(sized) if bound is not None and sized else dims[0]) if dims
                  else None, res.static_smem)
    if wide.threads > TARGET.max_threads:
        return (f"{wide.threads} threads a block{wide.at()}; {TARGET.arch} allows "
                f"{TARGET.max_threads}")
    if res.registers > TARGET.registers_per_thread:
        return (f"{res.registers} registers a thread; {TARGET.arch} allows "
                f"{TARGET.registers_per_thread}")
    regs = TARGET.block_registers(wide.threads, res.registers)
    if regs > TARGET.registers_per_block:
        warps = -(-wide.threads // TARGET.warp)
        return (f"{res.registers} registers a thread x {wide.threads} threads{wide.at()} take "
                f"{regs} registers a block ({TARGET.warp_registers(res.registers)} a warp, "
                f"allocated in units of {TARGET.register_unit}, x {warps} warps); "
                f"{TARGET.arch} allows {TARGET.registers_per_block} a block")
    # The launch contracts admit a launch's dynamic shared memory up to the limit, not
    # counting the static: with some, every served launch is weighed.
    most = max((_block(k, hd, res.static_smem) for hd in dims if res.static_smem),
               key=lambda b: b.shared, default=wide)
    if most.shared > TARGET.shared_per_block:
        return (f"{most.shared} bytes of shared memory a block{most.at()} ({res.static_smem} "
                f"static, {most.shared - res.static_smem} dynamic); {TARGET.arch} allows "
                f"{TARGET.shared_per_block} a block")
    return None
