"""The decode split plan, on the host.

Formula-identical to the device plan (templates/lib/plan.cuh.j2): the
device-position kernels recompute it from pos[0], and graph replays match
direct launches only while both sides agree.
"""

from __future__ import annotations

from dataclasses import dataclass

# The plan a cache object decodes with when none is given and none is tuned.
DEFAULT_KPS, DEFAULT_SPLITS_CAP = 256, 16

# The default plan derived from the device: splits of at least PLAN_MIN_KPS keys
# (shorter ones spend more on their partials and the combine than they save), as
# many as the context gives, capped where the blocks of all kv heads fill
# PLAN_WAVES blocks per SM.
PLAN_MIN_KPS, PLAN_WAVES = 256, 4


def default_plan(sm_count: int, n_head_kv: int) -> tuple[int, int]:
    """(kps, splits_cap) for a device of ``sm_count`` SMs decoding ``n_head_kv`` kv
    heads: more splits as the context grows (one per PLAN_MIN_KPS keys), at most
    PLAN_WAVES * sm_count blocks in all. Both numbers are launch arguments, so the
    device-position kernels follow the context the same way in a graph replay."""
    if sm_count < 1 or n_head_kv < 1:
        raise ValueError(f"default_plan needs a positive SM and kv head count; got "
                         f"{sm_count}, {n_head_kv}")
    return PLAN_MIN_KPS, max(1, -(-PLAN_WAVES * sm_count // n_head_kv))


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
