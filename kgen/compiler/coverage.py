"""What shapes each kernel accepts, computed from its axes with the launch
contracts themselves (kgen.runtime.bind.shape_refusal), so a tool can see
coverage without a GPU: `kgen list --json`."""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ir.geometry import block_threads, flash_shared_bytes
from kgen.ir.kernel import Kernel
from kgen.ir.target import TARGET
from kgen.runtime.bind import shape_refusal


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


def occupancy(k: Kernel, resources: dict, dims: list[int]) -> dict:
    """sm_37 occupancy of a flash kernel at the head sizes it serves among
    OCCUPANCY_HEAD_DIMS (its smallest if none), each at the most groups it allows:
    threads, shared bytes, and blocks and warps resident per multiprocessor, from
    ptxas's registers and static shared memory and the launch geometry."""
    out = {}
    for hd in [d for d in OCCUPANCY_HEAD_DIMS if d in dims] or dims[:1]:
        g = groups_by_head_dim(k, [hd])[hd]
        threads = block_threads(k, hd)
        shared = flash_shared_bytes(k, g, hd) + resources.get("static_smem", 0)
        blocks, warps = TARGET.occupancy(threads, resources["registers"], shared)
        out[str(hd)] = {"groups": g, "threads": threads, "shared_bytes": shared,
                        "blocks_per_sm": blocks, "warps_per_sm": warps}
    return out


def limits(k: Kernel, resources: dict | None = None) -> dict:
    """The shape limits of one kernel, as data; with ptxas's ``resources`` for it, its
    registers, stack frame and sm_37 occupancy too."""
    dims = head_dims(k)
    out: dict = {"head_dims": dims}
    if k.op is Op.FLASH:
        out["max_groups"] = k.max_groups
        out["groups_by_head_dim"] = groups_by_head_dim(k, dims)
        out["tile_keys"] = k.tile_keys
        out["dot_lanes"] = k.dot_lanes
    if k.fmt.shadows and k.op in (Op.FLASH, Op.KV_APPEND):
        out["sink_rows"], out["ring_rows"] = k.sink_rows, k.ring_rows
    if resources is not None:
        sm = {"registers": resources["registers"], "stack_frame": resources["stack_frame"],
              "spill_stores": resources["spill_stores"]}
        if k.op is Op.FLASH and dims:
            sm["occupancy"] = occupancy(k, resources, dims)
        out["sm_37"] = sm
    return out
