"""The decode split plan, on the host.

Formula-identical to the device plan (templates/lib/plan.cuh.j2): the
device-position kernels recompute it from pos[0], and graph replays match
direct launches only while both sides agree.
"""

from __future__ import annotations

from dataclasses import dataclass

# The plan a cache object decodes with when none is given and none is tuned.
DEFAULT_KPS, DEFAULT_SPLITS_CAP = 256, 16


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
