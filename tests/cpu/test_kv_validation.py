"""KVCache / SlotKVCache refuse bad arguments before touching the GPU or their state
(CPU only: a Guarded stand-in for CuPy records every allocation, upload and launch,
and each test ends with none)."""

from __future__ import annotations

import numpy as np
import pytest

from kgen.runtime import ContractError, kv
from kgen.testing.fakecupy import FakeArray, Guarded


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(kv, "allocate", lambda fmt, lead, *a: [None] * (
        2 + len(fmt.shadow_buffers())))
    cp = Guarded().install(monkeypatch)
    cp.armed = True
    yield cp
    cp.armed = False
    assert cp.touched == [], f"validation reached the GPU: {cp.touched}"


HD, NKV, MAX = 64, 2, 64


@pytest.fixture
def cache():
    return kv.KVCache(NKV, HD, MAX, kv="q4", sink=4, win=16)


@pytest.fixture
def slots():
    return kv.SlotKVCache(3, NKV, HD, MAX, kv="q4", sink=4, win=16)


def arr(shape, dtype=np.float32):
    """A GPU array's stand-in (never allocated)."""
    return FakeArray(shape, dtype)


def rows(n, heads=NKV, hd=HD, dtype=np.float32):
    return arr((n, heads, hd), dtype)


def refused(match, fn, *a, **kw):
    with pytest.raises(ContractError, match=match):
        fn(*a, **kw)


@pytest.mark.parametrize("pos0", [-1, MAX, MAX - 1, True, 1.0, "0", None])
def test_append_bounds(cache, pos0):
    refused("pos0|positions", cache.append, rows(2), rows(2), pos0)
    assert cache.length == 0


def test_append_shapes(cache):
    refused("k_new", cache.append, rows(2, hd=32), rows(2, hd=32), 0)
    refused("v_new", cache.append, rows(2), rows(3), 0)
    refused("k_new", cache.append, rows(2, dtype=np.float64), rows(2), 0)
    refused("k_new", cache.append, [[0.0]], rows(1), 0)


@pytest.mark.parametrize("kw, match", [
    (dict(scale=1e300), "scale"), (dict(scale=1e-60), "scale"), (dict(scale=float("nan")),
                                                                  "scale"),
    (dict(scale="1"), "scale"), (dict(scale=True), "scale"),
    (dict(attn_win=-5), "attn_win"), (dict(attn_win=2**40), "attn_win"),
    (dict(attn_sink=-1), "attn_sink"), (dict(attn_sink=1.5), "attn_sink"),
    (dict(kps=0), "kps"), (dict(kps=2**40), "kps"), (dict(splits_cap=-1), "splits_cap"),
])
def test_decode_scalars(cache, kw, match):
    q = arr((4, HD), np.float32)
    refused(match, cache.decode, q, rows(1), rows(1), 5, **kw)
    refused(match, cache.decode_device, q, rows(1), rows(1), None, **kw)
    assert cache.length == 0


@pytest.mark.parametrize("kw, match", [
    (dict(scale=1e300), "scale"), (dict(attn_win=-5), "attn_win"),
    (dict(attn_win=10**30), "attn_win"), (dict(pos0=-3), "pos0|positions"),
    (dict(pos0=MAX - 1), "positions"),
])
def test_prefill_scalars(cache, kw, match):
    args = {"pos0": 0, **kw}
    refused(match, cache.prefill, arr((2, 4, HD), np.float32), rows(2), rows(2), **args)


def test_prefill_and_decode_shapes(cache):
    refused("q must be", cache.prefill, [[1.0]], rows(1), rows(1), 0)
    refused("q must be", cache.prefill, arr((2, 4, 32), np.float32), rows(2), rows(2), 0)
    refused("rows", cache.prefill, arr((2, 4, HD), np.float32), rows(3), rows(3), 0)
    refused("q must be", cache.decode, arr((4, HD), np.float64), rows(1), rows(1), 0)
    refused("GQA", cache.decode, arr((3, HD), np.float32), rows(1), rows(1), 0)
    refused("pos", cache.decode, arr((4, HD), np.float32), rows(1), rows(1), MAX)


@pytest.mark.parametrize("pos, match", [
    ([-1, 0, 0], r"pos\[0\] = -1"), ([0, 0], "2 positions for 3 slots"),
    ([0, MAX, 0], r"pos\[1\] = 64"), ([0, 1.5, 0], r"pos\[1\] = 1.5"),
    ([0, True, 0], r"pos\[1\]"), (7, "one position per slot"),
])
def test_slots_positions(slots, pos, match):
    q = arr((3, 4, HD), np.float32)
    refused(match, slots.decode, q, rows(3), rows(3), pos)
    refused(match, slots.append, rows(3), rows(3), pos)


def test_slots_shapes_before_any_row_is_written(slots):
    q = arr((3, 4, HD), np.float32)
    refused("k_new", slots.decode, q, rows(2), rows(3), [0, 0, 0])
    refused("v_new", slots.decode, q, rows(3), rows(3, hd=32), [0, 0, 0])
    refused("q must be", slots.decode, arr((2, 4, HD), np.float32), rows(3), rows(3),
            [0, 0, 0])
    refused("GQA", slots.decode, arr((3, 3, HD), np.float32), rows(3), rows(3), [0, 0, 0])
    refused("scale", slots.decode, q, rows(3), rows(3), [0, 0, 0], scale=1e300)
    refused("attn_win", slots.decode, q, rows(3), rows(3), [0, 0, 0], attn_win=-5)


@pytest.mark.parametrize("kw", [dict(n_head_kv=0), dict(head_dim=2**40), dict(max_seq=True),
                                dict(sink=-1), dict(win=10**6), dict(kv="q5")])
def test_constructor(kw):
    args = {"n_head_kv": NKV, "head_dim": HD, "max_seq": MAX, "kv": "q4", **kw}
    with pytest.raises(ContractError):
        kv.KVCache(**args)


def test_slot_index(slots):
    for u in (-1, 3, True, 1.0):
        refused("slot", slots.slot, u)
