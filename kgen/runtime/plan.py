"""The decode split plan, on the host, and the key splits of a prefill.

Formula-identical to the device plan (templates/lib/plan.cuh.j2): the
device-position kernels recompute it from pos[0], and graph replays match
direct launches only while both sides agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from kgen.ir.axes import LOAD_PLACEMENT, Schedule
from kgen.ir.kernel import Kernel
from kgen.ir.target import TARGET, Target


@dataclass(frozen=True)
class PlanRule:
    """How a schedule's default plan follows the device: splits of at least
    ``min_kps`` keys, as many as the context gives, capped where the blocks of every kv
    head hold ``threads_per_sm`` threads an SM -- or, with none given, where they fill
    one wave of the blocks an SM holds at once (the kernel's occupancy on the device)
    -- and at ``max_splits`` (the combine folds the splits one after another). A launch
    decoding ``batch`` sequences at once (slots, paged requests) shares that cap among
    them, down to ``batch_floor`` splits a sequence; one sequence gets the whole cap,
    so the paged decode of one sequence plans as the dense one (the same bits)."""

    min_kps: int
    threads_per_sm: int | None = None
    max_splits: int | None = None
    batch_floor: int | None = None


# Measured on the H200 (make bench-kernels, decode_goals: 1 to 512 splits at 1k, 4k
# and 32k keys, every format, head_dim 128 and 256, 4 and 8 q heads per kv head): a
# block_tile decode keeps few loads in flight per thread and wants 8 blocks of 128
# threads an SM (within 1.03x of its best plan on geometric mean, 1.18x at worst). A
# hoisted warp_stream decode is fastest with one full wave of its resident blocks
# (head_dim 128: 4 blocks an SM, so 64 splits at 8 kv heads and 128 at 2 on 132 SMs;
# head_dim 256: 1, so 16 and 64), at most 128 splits (256 lost at 32k keys: 45.3 against
# 30.5 us at 16/2 heads, f16, a split's fixed cost outgrowing its keys; with the shared-
# memory staged combine still 35.3 against 26.5, and twice the default cap lost 1.03-1.51x
# wherever the context had keys for it -- f32, f16, q8_0, fp8_e4m3 and q4, head_dim 128
# and 256, 32/8 and 16/2 heads, 1k-32k keys -- but in one row, q4 at head_dim 128, 32/8
# heads and 32k keys, 98 splits against 49: 83.0 against 91.5 us); a fixed 256
# threads an SM was 1.29-1.50x off the best at head_dim 128 with 8 kv heads and 32k
# keys. On a K80 die (13 SMs, 128K registers an SM) the same rule gives
# head_dim 128's 8 blocks an SM 13 splits at 8 kv heads. Many sequences in one launch
# fill the waves by themselves: the paged decode of 32 sequences x 4k keys (head_dim
# 128, 8 kv heads; bench paged_goals) took 320 us at 16 splits, 354 at 32, 431 at 64
# (f32; f16 301, 335, 412), so a batch shares the cap down to 16 splits. The cap
# rounds down, so the blocks of a long context fill whole waves. Below the cap a split
# of the quads decodes (dq_*) is a chain of dependent steps, so short splits win: with
# the staged combine (its cost no longer grows a load a split) and the bench timing CUDA
# graphs of the launches (as an engine replays its step; raw launches from Python cost
# more than the kernels run), at head_dim 128 the best plan had 32-128 keys a split at
# 1k and 4k keys, so min_kps is 32 (128 before, measured with the serial combine and raw
# launches): f16 32/8 at 1k keys 11.0 us at 32 splits against 13.9 at 8 (min_kps 128's
# plan); in one run the default was within 1.00-1.10x of the best plan at 1k, 4k and 32k
# keys (f16, q8_0, fp8_e4m3; 32/8 and 16/2 heads; 1.10x at 16/2, 4k keys: 128 splits
# against 64). Long contexts still run at the cap. Both
# numbers are launch arguments, so the device-position kernels follow the context the
# same way in a graph replay; a single split (batch-invariant runs) is splits_cap = 1.
PLAN_RULES = {Schedule.BLOCK_TILE: PlanRule(16, threads_per_sm=1024),
              Schedule.WARP_STREAM: PlanRule(32, max_splits=128, batch_floor=16)}


def default_plan(device: Target, n_head_kv: int, block_threads: int, registers: int,
                 shared_bytes: int, schedule: Schedule, batch: int = 1) -> tuple[int, int]:
    """(kps, splits_cap) for decode blocks of ``block_threads`` threads, ``registers``
    a thread and ``shared_bytes`` each, of ``schedule``, on ``device`` (its SM count
    and per-SM limits) over ``n_head_kv`` kv heads, ``batch`` sequences a launch."""
    if min(device.sms, n_head_kv, block_threads, batch) < 1:
        raise ValueError(f"default_plan needs positive SM, kv head, thread and sequence "
                         f"counts; got {device.sms}, {n_head_kv}, {block_threads}, {batch}")
    rule = PLAN_RULES[schedule]
    if rule.threads_per_sm is not None:
        # Rounded down: one more split than fits puts a few blocks in a second wave (at
        # head_dim 256 with 8 kv heads on the H200, 17 splits took 263 us, 16 took 157).
        cap = rule.threads_per_sm * device.sms // (n_head_kv * block_threads)
    else:
        blocks, _ = device.occupancy(block_threads, registers, shared_bytes)
        cap = max(blocks, 1) * device.sms // n_head_kv
    if rule.max_splits is not None:
        cap = min(cap, rule.max_splits)
    if batch > 1 and rule.batch_floor is not None:
        cap = min(cap, max(cap // batch, rule.batch_floor))
    return rule.min_kps, max(1, cap)


# A query-tile prefill has a block per query tile of each kv head (and request): a chunk
# of 128 rows after a 4k context at 32/8 heads is 8 tiles x 8 kv heads = 64 blocks, each
# walking 4k keys, on 132 SMs that hold two such blocks each (H200). Its split form
# (key_split = partials) cuts each tile's keys into n_splits shares, as many as fill one
# wave of the resident blocks (rounded down, as the decode's cap), and the decode
# combine folds them. Measured on the H200 (make bench-kernels, prefill_split: 1-16
# splits, head_dim 128, 32/8 heads, chunks ending at 4096 keys, every output checked):
# the best split count was the one wave's in every case -- 16 at 32 rows (16 blocks), 8
# at 64, 4 at 128, 2 at 256 (f32 34.9, 42.8, 47.9, 50.7% of SGEMM; f16, q8_0 and
# fp8_e4m3 alike) -- and twice the splits cost 4-21%. On a 13-SM K80 die (two such
# blocks an SMX) the 128-row chunk's 64 blocks already fill 2.5 waves: one split, the
# whole kernel. At most PREFILL_MAX_SPLITS (the combine folds them one after another).
PREFILL_MAX_SPLITS = 16


def prefill_splits(device: Target, blocks: int, block_threads: int, registers: int,
                   shared_bytes: int) -> int:
    """Key splits for a query-tile prefill of ``blocks`` blocks (tiles x kv heads x
    requests) of ``block_threads`` threads, ``registers`` a thread and ``shared_bytes``
    each on ``device``: the most that keep them within one wave of the blocks its SMs
    hold at once; 1 (the whole form) where they fill a wave already."""
    if min(device.sms, blocks, block_threads) < 1:
        raise ValueError(f"prefill_splits needs positive SM, block and thread counts; got "
                         f"{device.sms}, {blocks}, {block_threads}")
    resident, _ = device.occupancy(block_threads, registers, shared_bytes)
    return max(1, min(max(resident, 1) * device.sms // blocks, PREFILL_MAX_SPLITS))


def family_registers(kernels) -> dict[tuple, int]:
    """The most registers a thread the build recorded in each plan family."""
    from kgen.runtime.record import forms_key, registers

    out: dict[tuple, int] = {}
    for x in kernels:
        r = registers(x)
        if r is not None:
            key = forms_key(x)
            out[key] = max(out.get(key, 0), r)
    return out


# The axes a split prefill's plan ignores: the options (a call with neutral options,
# another kernel of the same arithmetic, must split as the plain call does, to keep its
# bits) and the load placement (kgen.ir.axes.LOAD_PLACEMENT: the same arithmetic).
SPLIT_PLAN_IGNORES = ("window", "softcap", "sinks", *LOAD_PLACEMENT)


def split_family_registers(kernels) -> dict[tuple, int]:
    """The most registers a thread the build recorded in each split-plan family: the
    plan families (family_registers) with SPLIT_PLAN_IGNORES merged, so a split prefill
    and its siblings with other options or load placement plan alike
    (:func:`split_registers`)."""
    out: dict[tuple, int] = {}
    for key, regs in family_registers(kernels).items():
        merged = tuple(kv for kv in key if kv[0] not in SPLIT_PLAN_IGNORES)
        out[merged] = max(out.get(merged, 0), regs)
    return out


def split_registers(k: Kernel, table: dict[tuple, int]) -> int:
    """The registers a thread prefill_splits weighs for the split prefill ``k``: the
    most in its split-plan family (``table``: split_family_registers); the target's
    per-thread bound where the build recorded none."""
    from kgen.runtime.record import forms_key

    key = tuple(kv for kv in forms_key(k) if kv[0] not in SPLIT_PLAN_IGNORES)
    return table.get(key, TARGET.registers_per_thread)


def plan_registers(k: Kernel, table: dict[tuple, int]) -> int:
    """The registers a thread the default plan weighs for ``k``: the most in its plan
    family (``table``: family_registers), so every form of one decode gets one plan,
    hence the same bits (the paged decode the dense one's); the target's per-thread
    bound where the build recorded none."""
    from kgen.runtime.record import forms_key

    return table.get(forms_key(k), TARGET.registers_per_thread)


def plan_shared_bytes(k: Kernel, head_dim: int) -> int:
    """The shared memory a decode block of ``k`` at ``head_dim`` takes at its most q
    heads per kv head (the plan's bound: one figure for every group count)."""
    from kgen.ir.geometry import flash_shared_bytes

    return flash_shared_bytes(k, k.max_groups, head_dim)


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
