"""The decode split plan, on the host.

Formula-identical to the device plan (templates/lib/plan.cuh.j2): the
device-position kernels recompute it from pos[0], and graph replays match
direct launches only while both sides agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from kgen.ir.axes import Schedule
from kgen.ir.geometry import block_threads
from kgen.ir.kernel import Kernel

# The default plan derived from the device: per schedule, splits of at least its
# min_kps keys, as many as the context gives, capped where the blocks of every kv head
# hold its threads_per_sm threads per SM. Measured on the H200 (make bench-kernels,
# decode_goals: 1 to 512 splits at 1k, 4k and 32k keys, every format, head_dim 128 and
# 256, 4 and 8 q heads per kv head): a block_tile decode keeps few loads in flight per
# thread and wants 8 blocks of 128 threads an SM (within 1.03x of its best plan on
# geometric mean, 1.18x at worst); a hoisted warp_stream unit keeps 4 keys in flight
# and wants 256 threads (1.02x mean, 1.44x worst: head_dim 128 at 8 kv heads would take
# twice the splits, head_dim 256 at 2 kv heads half). The cap rounds down, so the
# blocks of a long context fill whole waves. Both numbers are launch arguments,
# so the device-position kernels follow the context the same way in a graph replay;
# a single split (batch-invariant runs) is splits_cap = 1.
PLAN_RULES = {Schedule.BLOCK_TILE: (16, 1024), Schedule.WARP_STREAM: (64, 256)}


def default_plan(sm_count: int, n_head_kv: int, block_threads: int,
                 schedule: Schedule) -> tuple[int, int]:
    """(kps, splits_cap) for a decode block of ``block_threads`` threads and
    ``schedule`` on a device of ``sm_count`` SMs over ``n_head_kv`` kv heads."""
    if min(sm_count, n_head_kv, block_threads) < 1:
        raise ValueError(f"default_plan needs positive SM, kv head and thread counts; got "
                         f"{sm_count}, {n_head_kv}, {block_threads}")
    min_kps, per_sm = PLAN_RULES[schedule]
    # Rounded down: one more split than fits puts a few blocks in a second wave (at
    # head_dim 256 with 8 kv heads on the H200, 17 splits took 263 us, 16 took 157).
    return min_kps, max(1, per_sm * sm_count // (n_head_kv * block_threads))


@dataclass(frozen=True)
class DecodePlan:
    seq_len: int
    n_splits: int
    split_len: int

    def bounds(self, split: int) -> tuple[int, int]:
        lo = split * self.split_len
        return lo, min(lo + self.split_len, self.seq_len)


def decode_plan(seq_len: int, kps: int, cap: int, tile: int = 16) -> DecodePlan:
    """About ``kps`` keys per split, at most ``cap`` splits, whole tiles per split.

    Integer arithmetic exactly as the kernels do it (C division of positive
    ints truncates like //).
    """
    if seq_len < 1 or kps < 1 or cap < 1:
        raise ValueError(f"decode_plan needs positive seq_len, kps, cap; got "
                         f"{seq_len}, {kps}, {cap}")
    n = (seq_len + kps - 1) // kps
    n = min(max(n, 1), cap)
    split_len = (seq_len + n - 1) // n
    split_len = (split_len + tile - 1) & ~(tile - 1)
    return DecodePlan(seq_len, (seq_len + split_len - 1) // split_len, split_len)


def given_plan(kps, splits_cap, who: str = "KVCache") -> tuple[int | None, int | None]:
    """The plan values a caller gave, checked (positive ints); None where not given."""
    from kgen.runtime.options import positive

    return (None if kps is None else positive("kps", kps, who),
            None if splits_cap is None else positive("splits_cap", splits_cap, who))


def kernel_plan(k: Kernel, head_dim: int, n_head_kv: int, kps=None, splits_cap=None,
                who: str = "KVCache") -> tuple[int, int]:
    """(kps, splits_cap) for decoding with ``k``: the given values, checked (positive
    ints), the missing ones from default_plan on the current device (asked only then)."""
    kps, splits_cap = given_plan(kps, splits_cap, who)
    if kps is not None and splits_cap is not None:
        return kps, splits_cap
    from kgen.runtime.device import sm_count

    dk, dc = default_plan(sm_count(), n_head_kv, block_threads(k, head_dim), k.schedule)
    return (dk if kps is None else kps), (dc if splits_cap is None else splits_cap)
