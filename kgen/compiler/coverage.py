"""What shapes each kernel accepts, computed from its axes with the launch
contracts themselves (kgen.runtime.bind.shape_refusal), so a tool can see
coverage without a GPU: `kgen list --json`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kgen.ir.kernel import Kernel
from kgen.ir.target import TARGET
from kgen.ops import get
from kgen.runtime.bind import shape_refusal
from kgen.runtime.record import Built
from kgen.toolchain.resources import Resources


def head_dims(k: Kernel) -> list[int]:
    """Every head_dim (up to a block's thread limit) ``k`` launches with one group."""
    if not get(k.op).takes_head_dim:
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
    op = get(k.op)
    for hd in wanted:
        g, row = groups, {}
        if op.grouped_block:  # at the most groups the head_dim fits, unless a launch's
            g = groups if groups is not None else groups_by_head_dim(k, [hd])[hd]
            row = {"groups": g}
        threads, dynamic = op.occupancy_block(k, hd, g)
        shared = resources.get("static_smem", 0) + dynamic
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
    op = get(k.op)
    out: dict = {"head_dims": dims}
    if op.grouped_block:
        out["max_groups"] = k.max_groups
        out["groups_by_head_dim"] = groups_by_head_dim(k, dims)
    out.update(op.limit_facts(k))
    if op.cache and k.pair.shadows:
        out["sink_rows"], out["ring_rows"] = k.sink_rows, k.ring_rows
    if resources is not None:
        sm = {"registers": resources["registers"], "stack_frame": resources["stack_frame"],
              "spill_stores": resources["spill_stores"]}
        if op.lists_occupancy and dims:
            sm["occupancy"] = occupancy(k, resources, dims)
        out["sm_37"] = sm
    return out


# -- does one block fit the target, with ptxas's registers and static shared memory ------

def sized_head_dim(k: Kernel) -> int | None:
    """The widest head_dim a kernel's own axes size it for: register K's chunk
    (kreg_max_chunk * dot_lanes), a query_tile thread's output patch (max_head_dim),
    the shared-V tile (tile_keys * dot_lanes), an append's static staging
    (max_head_dim), a DFlash or dense warp's q and output rows in registers
    (max_head_dim); None where only the target's block limit bounds its head_dim."""
    return get(k.op).sized_head_dim(k)


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
    op = get(k.op)
    step = op.served_step(k)
    if step is not None:
        return [hd for hd in range(step, TARGET.max_threads + 1, step)
                if shape_refusal(k, hd, 1) is None]
    if not op.takes_head_dim:
        return []

    def first(dims: range) -> list[int]:
        return next(([hd] for hd in dims if shape_refusal(k, hd, 1) is None), [])

    top = TARGET.max_threads
    ends = first(range(1, top + 1)) + first(range(top, 0, -1))
    if bound is not None:
        ends += first(range(min(bound, top), 0, -1))
    return sorted(set(ends))


def _block(k: Kernel, hd: int | None, static: int) -> Block:
    """A block of ``k`` at head_dim ``hd`` (None: a launch without one) with ``static``
    shared bytes, as its op shapes it (OpDef.block_shape)."""
    op = get(k.op)
    groups = groups_by_head_dim(k, [hd])[hd] if op.grouped_block else None  # the most it fits
    threads, dynamic = op.block_shape(k, hd, groups)
    return Block(hd, groups, threads, static + dynamic)


def block_misfit(k: Kernel, res: Resources) -> str | None:
    """Why a block of ``k`` cannot launch on the target, with ptxas's registers and
    static shared memory (None when it fits): its threads and registers a block (the
    allocation per warp that occupancy counts) at the widest launch its axes size it
    for (its smallest launch where the target alone bounds its head_dim), and its
    shared memory, static and dynamic, at the launch that needs the most."""
    bound = sized_head_dim(k)
    dims = _served(k, bound)
    if get(k.op).takes_head_dim and not dims:
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
