"""The default decode plan derived from the device (kgen.runtime.plan.default_plan)."""

from __future__ import annotations

import pytest

from kgen.ir.axes import Schedule
from kgen.runtime.plan import PLAN_RULES, decode_plan, default_plan


@pytest.mark.parametrize("schedule", list(PLAN_RULES))
@pytest.mark.parametrize("sms", [13, 132])  # a K80 die, an H200
def test_splits_grow_with_the_context_up_to_whole_waves(schedule, sms):
    min_kps, per_sm = PLAN_RULES[schedule]
    for n_kv, threads in ((8, 128), (2, 256), (1, 64), (64, 1024)):
        kps, cap = default_plan(sms, n_kv, threads, schedule)
        assert kps == min_kps and cap >= 1
        # the blocks of every kv head at the cap fit the SMs' share of threads
        assert cap == 1 or cap * n_kv * threads <= per_sm * sms
        assert (cap + 1) * n_kv * threads > per_sm * sms
        counts = [decode_plan(seq, kps, cap).n_splits for seq in (1, 100, 1000, 10**4, 10**5)]
        assert counts == sorted(counts) and counts[0] == 1 and counts[-1] <= cap


def test_more_sms_more_splits():
    small = default_plan(13, 8, 128, Schedule.WARP_STREAM)[1]
    big = default_plan(132, 8, 128, Schedule.WARP_STREAM)[1]
    assert big > small


@pytest.mark.parametrize("bad", [(0, 8, 128), (13, 0, 128), (13, 8, 0)])
def test_refuses_empty_devices_and_blocks(bad):
    with pytest.raises(ValueError):
        default_plan(*bad, Schedule.BLOCK_TILE)
