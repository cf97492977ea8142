"""The GPU the kernels are compiled for: its limits, in one place.

The spec checks, the launchers' contracts and the launch geometry all ask this
object; nothing else spells these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Target:
    arch: str                 # nvcc/ptxas -arch
    warp: int                 # threads per warp (shuffle width)
    max_threads: int          # threads per block
    shared_per_block: int     # bytes of shared memory one block may use
    registers_per_thread: int
    grid_x_max: int
    grid_yz_max: int
    # One multiprocessor (what occupancy is counted against) and the chip.
    sms: int                  # multiprocessors of one die (a K80 board holds two dies)
    threads_per_sm: int
    blocks_per_sm: int
    registers_per_sm: int
    registers_per_block: int
    shared_per_sm: int        # bytes, with the L1 split that gives shared memory the most
    register_unit: int        # registers are allocated per warp in units of this many
    shared_unit: int          # bytes of shared memory are allocated in units of this

    @property
    def max_shadow_rows(self) -> int:
        """Rows of an fp16 sink or window shadow: a kernel addresses a head's shadow
        rows as ``head * rows * head_dim`` in int, so rows * max_threads * warp (heads)
        must stay below 2**31."""
        return (2**31 - 1) // (self.max_threads * self.warp)

    def fits_block(self, threads: int) -> bool:
        return 1 <= threads <= self.max_threads

    def warp_registers(self, registers: int) -> int:
        """Registers one warp is allocated for ``registers`` a thread: per warp, in
        units of ``register_unit``."""
        return -(-max(registers, 1) * self.warp // self.register_unit) * self.register_unit

    def block_registers(self, threads: int, registers: int) -> int:
        """Registers a block of ``threads`` threads of ``registers`` each is allocated
        (whole warps): what ``registers_per_block`` bounds."""
        return -(-threads // self.warp) * self.warp_registers(registers)

    def occupancy(self, threads: int, registers: int, shared_bytes: int) -> tuple[int, int]:
        """(blocks, warps) resident on one multiprocessor for blocks of ``threads``
        threads using ``registers`` registers each and ``shared_bytes`` of shared memory
        (dynamic and static); (0, 0) when one block does not fit."""
        warps = -(-threads // self.warp)
        per_warp = self.warp_registers(registers)
        if (threads > self.max_threads or per_warp * warps > self.registers_per_block
                or shared_bytes > self.shared_per_block):
            return 0, 0
        shared = -(-shared_bytes // self.shared_unit) * self.shared_unit
        blocks = min(self.blocks_per_sm, self.threads_per_sm // (warps * self.warp),
                     self.registers_per_sm // (per_warp * warps),
                     self.shared_per_sm // shared if shared else self.blocks_per_sm)
        return blocks, blocks * warps

    def on_device(self, sms: int, threads_per_sm: int | None = None,
                  blocks_per_sm: int | None = None, registers_per_sm: int | None = None,
                  shared_per_sm: int | None = None) -> Target:
        """This target's per-block limits (what the kernels were compiled against) on a
        device of ``sms`` multiprocessors with its own per-SM limits (each left out: this
        target's): what a kernel's residency on that device is counted against."""
        return replace(self, sms=sms,
                       threads_per_sm=threads_per_sm or self.threads_per_sm,
                       blocks_per_sm=blocks_per_sm or self.blocks_per_sm,
                       registers_per_sm=registers_per_sm or self.registers_per_sm,
                       shared_per_sm=shared_per_sm or self.shared_per_sm)


# Kepler GK210 (one die of a Tesla K80), compute capability 3.7: 13 SMs, each with 2048
# threads, 16 blocks, 128K 32-bit registers (64K to one block) and 112 KB of shared
# memory (48 KB to one block).
SM_37 = Target(arch="sm_37", warp=32, max_threads=1024, shared_per_block=48 * 1024,
               registers_per_thread=255, grid_x_max=2**31 - 1, grid_yz_max=65535,
               sms=13, threads_per_sm=2048, blocks_per_sm=16, registers_per_sm=128 * 1024,
               registers_per_block=64 * 1024, shared_per_sm=112 * 1024, register_unit=256,
               shared_unit=256)

TARGET = SM_37
