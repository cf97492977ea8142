"""Launch geometry derived from a kernel's axes: the one formula for the
dynamic shared memory a flash kernel needs, used by the spec checks and by
the Python launchers (the templates lay the regions out in the same order)."""

from __future__ import annotations

from kgen.spec.axes import Q4_BLOCK, Q4_BLOCK_BYTES, KStage, QStage, VStage
from kgen.spec.ir import Kernel


def q4_row_bytes(head_dim: int) -> int:
    return head_dim // Q4_BLOCK * Q4_BLOCK_BYTES


def flash_shared_bytes(k: Kernel, groups: int, head_dim: int) -> int:
    """q group | K tile | scores [G][T] | probs [T][G] | m, l, corr [G] | V tile."""
    T = k.tile_keys
    q = groups * head_dim * (2 if k.q_stage is QStage.F16 else 4)
    k_elem = {KStage.SHARED_F32: 4, KStage.SHARED_F16: 2, KStage.REGISTERS: 0}[k.k_stage]
    k_tile = T * (head_dim + k.k_pad) * k_elem
    state = 4 * (2 * groups * T + 3 * groups)
    v_tile = T * q4_row_bytes(head_dim) if k.v_stage is VStage.SHARED_Q4 else 0
    return q + k_tile + state + v_tile
