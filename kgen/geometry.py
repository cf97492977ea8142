"""Launch geometry derived from a kernel's axes: the one home of the derived
quantities the spec checks, the launchers, the references and the cache objects
share -- the flash kernels' dynamic shared memory, the smallest head_dim a block
scores every key with, and a cache row's width (asked of the kernel's format)."""

from __future__ import annotations

import math

from kgen.spec.axes import KStage, QStage, Threads, VStage
from kgen.spec.ir import Kernel
from kgen.target import TARGET


def row_width(k: Kernel, head_dim: int) -> int:
    """Array elements of one cache row of ``k``'s KV format."""
    return k.fmt.row_width(head_dim)


def tile_threads(k: Kernel) -> int:
    """Threads that score one tile: every key of a tile has its own dot lanes."""
    return k.tile_keys * k.dot_lanes


def padded(k: Kernel) -> bool:
    return k.threads is Threads.WARPS


def block_threads(k: Kernel, head_dim: int) -> int:
    """Threads of a flash block: one per output dim, or that rounded up to whole warps."""
    if padded(k):
        return -(-head_dim // TARGET.warp) * TARGET.warp
    return head_dim


def head_dim_step(k: Kernel) -> int:
    """head_dim must be a multiple of this: whole warps (the dot shuffles use
    full-warp masks) or, in a padded block, whole dot chunks; and whole blocks of
    the format."""
    base = k.dot_lanes if padded(k) else TARGET.warp
    return math.lcm(base, k.fmt.block)


def min_head_dim(k: Kernel) -> int:
    """The smallest head_dim a flash block runs with: every key of a tile scored,
    whole warps (or dot chunks), whole format blocks."""
    step = head_dim_step(k)
    hd = step
    while block_threads(k, hd) < tile_threads(k):
        hd += step
    return hd


def flash_shared_bytes(k: Kernel, groups: int, head_dim: int) -> int:
    """q group | K tile | scores [G][T] | probs [T][G] | m, l, corr [G] | V tile."""
    T = k.tile_keys
    q = groups * head_dim * (2 if k.q_stage is QStage.F16 else 4)
    k_elem = {KStage.SHARED_F32: 4, KStage.SHARED_F16: 2, KStage.REGISTERS: 0}[k.k_stage]
    k_tile = T * (head_dim + k.k_pad) * k_elem
    state = 4 * (2 * groups * T + 3 * groups)
    v_tile = T * k.fmt.row_bytes(head_dim) if k.v_stage is VStage.SHARED_Q4 else 0
    return q + k_tile + state + v_tile
