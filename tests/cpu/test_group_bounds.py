"""A quads decode scores every head up to its group bound with no branch per head, so the
caches must pick, for each group count, the quads form with the tightest bound that
serves it (a multi-head model's one group gets the 1-group form, not the 4-group one),
and the same arithmetic in every position form (host, device, slots, paged: the paged
form bit for bit the dense one). Every format, head size and bound comes from the built
kernels, never a literal. CPU only."""

from __future__ import annotations

import pytest

from kgen.ir.axes import Mode, Op, Position
from kgen.ir.geometry import stream_head_dim, stream_quads
from kgen.runtime.record import forms_key
from kgen.runtime.select import Role, find, generated
from kgen.testing.built import needs_build

pytestmark = needs_build


@pytest.fixture(scope="module")
def pool():
    return generated()


def _quads(pool) -> dict[tuple, list]:
    """Quads decodes of one format (K and V alike) by (kv, position, head_dim)."""
    out: dict[tuple, list] = {}
    for k, _ in pool:
        if (k.op is Op.FLASH and k.mode is Mode.DECODE and stream_quads(k)
                and k.kv is k.v_kv):
            out.setdefault((k.kv.value, k.position, stream_head_dim(k)), []).append(k)
    return out


def test_each_group_count_gets_the_tightest_quads_bound_in_every_position(pool):
    quads = _quads(pool)
    assert any(min(k.max_groups for k in ks) == 1 for ks in quads.values())
    checked = 0
    for kv, hd in sorted({(kv, hd) for kv, _, hd in quads}):
        chosen_by_groups: dict[int, set] = {}
        for position in Position:
            ks = quads.get((kv, position, hd))
            if not ks:
                continue
            for groups in range(1, max(k.max_groups for k in ks) + 1):
                k, _ = find(Role(Op.FLASH, position, Mode.DECODE, kv), hd, groups,
                            kernels=pool)
                tightest = min(x.max_groups for x in ks if x.max_groups >= groups)
                assert stream_quads(k) and stream_head_dim(k) == hd, (kv, hd, groups, k.name)
                assert k.max_groups == tightest, (kv, position, hd, groups, k.name)
                chosen_by_groups.setdefault(groups, set()).add(forms_key(k))
                checked += 1
        for groups, keys in chosen_by_groups.items():
            assert len(keys) == 1, f"{kv} hd{hd} groups {groups}: positions differ"
    assert checked


def test_every_quads_head_size_has_each_bound_in_every_position_form(pool):
    """The bounds a (format, head_dim) has are the same in each position form it has, so
    no form falls back to a looser bound (and other bits) than its siblings."""
    quads = _quads(pool)
    for kv, hd in {(kv, hd) for kv, _, hd in quads}:
        bounds = {pos: sorted(k.max_groups for k in quads[(kv, pos, hd)])
                  for pos in Position if (kv, pos, hd) in quads}
        assert len({tuple(b) for b in bounds.values()}) == 1, (kv, hd, bounds)
