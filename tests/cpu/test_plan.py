"""The default decode plan derived from the device (kgen.runtime.plan.default_plan)."""

from __future__ import annotations

import pytest

from kgen.ir.axes import Schedule
from kgen.ir.target import TARGET
from kgen.runtime.plan import PLAN_RULES, decode_plan, default_plan

K80 = TARGET.on_device(13)  # a K80 die
H200 = TARGET.on_device(132, 2048, 32, 64 * 1024, 228 * 1024)
BLOCKS = ((8, 128, 128), (2, 256, 166), (1, 64, 40), (64, 1024, 32), (8, 128, 255))


@pytest.mark.parametrize("schedule", list(PLAN_RULES))
@pytest.mark.parametrize("device", [K80, H200], ids=["k80", "h200"])
def test_splits_grow_with_the_context_up_to_whole_waves(schedule, device):
    rule = PLAN_RULES[schedule]
    for n_kv, threads, regs in BLOCKS:
        kps, cap = default_plan(device, n_kv, threads, regs, 4096, schedule)
        assert kps == rule.min_kps and cap >= 1
        assert rule.max_splits is None or cap <= rule.max_splits
        if rule.threads_per_sm is not None:
            # the blocks of every kv head at the cap fit the SMs' share of threads
            budget = rule.threads_per_sm * device.sms
            assert cap == 1 or cap * n_kv * threads <= budget
            assert (cap + 1) * n_kv * threads > budget or cap == rule.max_splits
        else:
            # the blocks of every kv head at the cap fill one wave of resident blocks
            resident = max(device.occupancy(threads, regs, 4096)[0], 1) * device.sms
            assert cap == 1 or cap * n_kv <= resident
            assert (cap + 1) * n_kv > resident or cap == rule.max_splits
        counts = [decode_plan(seq, kps, cap).n_splits for seq in (1, 100, 1000, 10**4, 10**5)]
        assert counts == sorted(counts) and counts[0] == 1 and counts[-1] <= cap


@pytest.mark.parametrize("schedule", list(PLAN_RULES))
def test_more_sms_more_splits(schedule):
    small = default_plan(K80, 8, 128, 128, 4096, schedule)[1]
    big = default_plan(TARGET.on_device(132), 8, 128, 128, 4096, schedule)[1]
    assert big > small


def test_the_stream_cap_follows_the_blocks_a_multiprocessor_holds():
    """Fewer registers a thread, more resident blocks, more splits: on the H200's
    64K registers an SM, 128 a thread hold 4 blocks of 128 threads (66 splits over 8 kv
    heads), 166 at 256 threads hold 1 (16 splits); at 2 kv heads the cap is the
    combine's bound."""
    stream = Schedule.WARP_STREAM
    kps = PLAN_RULES[stream].min_kps
    assert default_plan(H200, 8, 128, 128, 4224, stream) == (kps, 66)
    assert default_plan(H200, 8, 256, 166, 8448, stream) == (kps, 16)
    assert default_plan(H200, 2, 128, 128, 4224, stream) == (kps, PLAN_RULES[stream].max_splits)
    assert default_plan(K80, 8, 128, 128, 4224, stream) == (kps, 13)


@pytest.mark.parametrize("device", [K80, H200], ids=["k80", "h200"])
def test_a_batch_shares_the_cap_down_to_its_floor(device):
    """One sequence gets the whole cap (the dense plan: the paged decode of one
    sequence keeps the dense bits); more sequences in a launch share it, never below
    the rule's batch_floor nor above the one-sequence cap."""
    stream = Schedule.WARP_STREAM
    floor = PLAN_RULES[stream].batch_floor
    for n_kv, threads, regs in BLOCKS:
        one = default_plan(device, n_kv, threads, regs, 4096, stream)
        assert default_plan(device, n_kv, threads, regs, 4096, stream, batch=1) == one
        caps = [default_plan(device, n_kv, threads, regs, 4096, stream, batch=b)[1]
                for b in (1, 2, 4, 32, 1000)]
        assert caps == sorted(caps, reverse=True)
        assert all(c == one[1] or c == max(one[1] // b, floor)
                   for c, b in zip(caps, (1, 2, 4, 32, 1000), strict=True))
        assert caps[-1] == min(one[1], floor)
    # The H200's 32 paged sequences at head_dim 128 over 8 kv heads: 66 for one, 16 each.
    kps = PLAN_RULES[stream].min_kps
    assert default_plan(H200, 8, 128, 128, 4224, stream, batch=32) == (kps, 16)


@pytest.mark.parametrize("bad", [(0, 8, 128, 1), (13, 0, 128, 1), (13, 8, 0, 1),
                                 (13, 8, 128, 0)])
def test_refuses_empty_devices_blocks_and_batches(bad):
    with pytest.raises(ValueError):
        default_plan(TARGET.on_device(bad[0]), bad[1], bad[2], 64, 0, Schedule.BLOCK_TILE,
                     batch=bad[3])
