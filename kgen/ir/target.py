"""The GPU the kernels are compiled for: its limits, in one place.

The spec checks, the launchers' contracts and the launch geometry all ask this
object; nothing else spells these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    arch: str                 # nvcc/ptxas -arch
    warp: int                 # threads per warp (shuffle width)
    max_threads: int          # threads per block
    shared_per_block: int     # bytes of shared memory one block may use
    registers_per_thread: int
    grid_x_max: int
    grid_yz_max: int

    @property
    def max_shadow_rows(self) -> int:
        """Rows of an fp16 sink or window shadow: a kernel addresses a head's shadow
        rows as ``head * rows * head_dim`` in int, so rows * max_threads * warp (heads)
        must stay below 2**31."""
        return (2**31 - 1) // (self.max_threads * self.warp)

    def fits_block(self, threads: int) -> bool:
        return 1 <= threads <= self.max_threads


# Kepler GK210 (Tesla K80), compute capability 3.7.
SM_37 = Target(arch="sm_37", warp=32, max_threads=1024, shared_per_block=48 * 1024,
               registers_per_thread=255, grid_x_max=2**31 - 1, grid_yz_max=65535)

TARGET = SM_37
