"""More q heads per kv head than any decode's group bound (multi-query models of 48 or
71 heads): the caches' decode runs the step as a one-row prefill, through the query tile
whose rows pack the q heads -- KVCache and SlotKVCache a row at the slot's position,
PagedKVCache one row a sequence -- and refuses a plan it cannot follow before it touches
anything. Group counts a decode serves keep their decode. The bounds come from the
built kernels (the manifest's). CPU only: CuPy is kgen.testing.fakecupy, recording every
launch."""

from __future__ import annotations

import pytest

from kgen.ir.axes import Mode, Op
from kgen.ir.geometry import query_tiles
from kgen.runtime import ContractError, tuned
from kgen.runtime.kv import KVCache, SlotKVCache
from kgen.runtime.paged import PagedKVCache
from kgen.runtime.select import generated
from kgen.testing.built import needs_build
from kgen.testing.fakecupy import FakeCupy

pytestmark = needs_build
HD, MS, NB, BS = 128, 64, 8, 16  # head_dim, max_seq; paged: blocks, positions a block


@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(tuned, "tuned", lambda *a: None)
    monkeypatch.setattr(tuned, "tuned_prefill", lambda *a: None)
    return FakeCupy().install(monkeypatch)


@pytest.fixture(scope="module")
def bounds() -> tuple[int, int, dict]:
    """(the widest decode's group bound at HD, the widest query tile's, kernels by name)."""
    built = {k.name: k for k, _ in generated()}
    flash = [k for k in built.values() if k.op is Op.FLASH and k.kv.value == "f32"
             and k.v_kv.value == "f32"]
    decode = max(k.max_groups for k in flash if k.mode is Mode.DECODE)
    tile = max(k.max_groups for k in flash if query_tiles(k))
    assert tile > decode, "no query tile serves more groups than every decode"
    return decode, tile, built


def _kinds(cp, first: int, built: dict) -> set[str]:
    """What the launches since ``first`` were: decode, query_tile, or other (append,
    combine)."""
    out = set()
    for name, *_ in cp.launched[first:]:
        k = built[name]
        out.add("query_tile" if query_tiles(k) else
                "decode" if k.op is Op.FLASH and k.mode is Mode.DECODE else "other")
    return out


def test_a_dense_decode_past_every_decode_bound_is_a_one_row_prefill(cp, bounds):
    decode, tile, built = bounds
    cache = KVCache(1, HD, MS, kv="f32")
    q, row = cp.empty((decode + 1, HD)), cp.empty((1, 1, HD))
    first = len(cp.launched)
    out = cache.decode(q, row, row, 9)
    assert out.shape == (decode + 1, HD) and cache.length == 10
    assert _kinds(cp, first, built) >= {"query_tile"}
    assert "decode" not in _kinds(cp, first, built)
    assert cache.last_plan[2] == "prefill"
    # Within a decode's bound the decode runs.
    first = len(cp.launched)
    cache.decode(cp.empty((decode, HD)), row, row, 10)
    assert "decode" in _kinds(cp, first, built) and cache.last_plan[2] != "prefill"


def test_a_plan_the_one_row_prefill_cannot_follow_is_refused_untouched(cp, bounds):
    decode, _, _ = bounds
    cache = KVCache(1, HD, MS, kv="f32")
    q, row = cp.empty((decode + 1, HD)), cp.empty((1, 1, HD))
    for plan in (dict(kps=16), dict(splits_cap=4)):
        first = len(cp.launched)
        with pytest.raises(ContractError, match="kps and splits_cap"):
            cache.decode(q, row, row, 9, **plan)
        assert len(cp.launched) == first and cache.length == 0 and cache.last_plan is None


def test_past_the_query_tiles_bound_too_the_decode_is_refused_untouched(cp, bounds):
    _, tile, _ = bounds
    cache = KVCache(1, HD, MS, kv="f32")
    row = cp.empty((1, 1, HD))
    first = len(cp.launched)
    with pytest.raises(ContractError, match="no generated kernel serves"):
        cache.decode(cp.empty((tile + 1, HD)), row, row, 9)
    assert len(cp.launched) == first and cache.length == 0


def test_slot_and_paged_decodes_past_every_decode_bound_are_one_row_prefills(cp, bounds):
    decode, _, built = bounds
    G = decode + 1
    slots = SlotKVCache(3, 1, HD, MS, kv="f32")
    first = len(cp.launched)
    out = slots.decode(cp.empty((3, G, HD)), cp.empty((3, 1, HD)), cp.empty((3, 1, HD)),
                       [4, 0, 9])
    assert out.shape == (3, G, HD)
    assert "query_tile" in _kinds(cp, first, built)
    assert "decode" not in _kinds(cp, first, built)
    with pytest.raises(ContractError, match="kps and splits_cap"):
        slots.decode(cp.empty((3, G, HD)), cp.empty((3, 1, HD)), cp.empty((3, 1, HD)),
                     [4, 0, 9], kps=16)

    paged = PagedKVCache(NB, BS, 1, HD, kv="f32")
    a, b = paged.add(), paged.add()
    paged.prefill([a, b], cp.empty((30, G, HD)), cp.empty((30, 1, HD)),
                  cp.empty((30, 1, HD)), [10, 20])
    first = len(cp.launched)
    out = paged.decode([a, b], cp.empty((2, G, HD)), cp.empty((2, 1, HD)),
                       cp.empty((2, 1, HD)))
    assert out.shape == (2, G, HD) and paged.lengths == {a: 11, b: 21}
    assert "query_tile" in _kinds(cp, first, built)
    assert "decode" not in _kinds(cp, first, built)
    with pytest.raises(ContractError, match="kps and splits_cap"):
        paged.decode([a, b], cp.empty((2, G, HD)), cp.empty((2, 1, HD)),
                     cp.empty((2, 1, HD)), splits_cap=4)
    assert paged.lengths == {a: 11, b: 21}
