"""KVCache.decode replays a step like an earlier one (same shapes, options and
plan) without deriving it again: it launches exactly what a step checked and
derived in full launches, and refuses exactly what that one refuses. CPU only:
CuPy is kgen.testing.fakecupy, whose kernel functions record their launches."""

from __future__ import annotations

import numpy as np
import pytest

from kgen.ir.geometry import block_threads
from kgen.ir.target import TARGET
from kgen.runtime import ContractError, kv, plan, tuned
from kgen.runtime.select import generated
from kgen.testing.fakecupy import FakeCupy

HK, H, HD, MS = 2, 4, 256, 64


@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(tuned, "tuned", lambda *a: None)
    return FakeCupy().install(monkeypatch)


@pytest.fixture
def full_steps(monkeypatch):
    """How many decode steps were derived in full (not replayed)."""
    count = [0]
    real = kv.KVCache._device_step

    def counted(self, *a, **k):
        count[0] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(kv.KVCache, "_device_step", counted)
    return count


def _cache(kind: str) -> kv.KVCache:
    return kv.KVCache(HK, HD, MS, kv=kind, **({"sink": 4, "win": 16} if kind == "q4" else {}))


def _step(cp):
    return cp.empty((H, HD)), cp.empty((1, HK, HD)), cp.empty((1, HK, HD))


def _same_launches(a: list, b: list) -> None:
    """Kernel, geometry and arguments alike: arrays the same objects (or, for the
    fresh outputs, alike), scalars equal and of one type."""
    assert [x[:3] + x[4:] for x in a] == [x[:3] + x[4:] for x in b]
    for (name, *_, args, _, _), (_, *_, other, _, _) in zip(a, b, strict=True):
        assert len(args) == len(other), name
        for x, y in zip(args, other, strict=True):
            assert type(x) is type(y), name
            if isinstance(x, np.generic):
                assert x == y and np.signbit(x) == np.signbit(y), name
            elif x is not y:
                assert (x.shape, x.dtype) == (y.shape, y.dtype), name


@pytest.mark.parametrize("kind", ["f32", "q4"])
@pytest.mark.parametrize("kw", [dict(kps=16, splits_cap=4), {}, dict(scale=0.25),
                                dict(window_size=(8, 0), kps=16, splits_cap=4)])
def test_a_replayed_step_launches_what_a_full_step_launches(cp, full_steps, kind, kw):
    cache = _cache(kind)
    q, k1, v1 = _step(cp)
    cache.decode(q, k1, v1, 10, **kw)
    assert full_steps[0] == 1
    first = len(cp.launched)
    out = cache.decode(q, k1, v1, 11, **kw)
    replayed, plan = cp.launched[first:], cache.last_plan
    assert full_steps[0] == 1 and len(replayed) == 3 and cache.length == 12
    assert cp.launched[-1][3][3] is out  # the combine writes the step's output
    assert cache._pos.host.tolist() == [11]
    cache._steps.clear()
    first = len(cp.launched)
    cache.decode(q, k1, v1, 11, **kw)
    assert full_steps[0] == 2 and cache.last_plan == plan
    _same_launches(replayed, cp.launched[first:])


@pytest.mark.parametrize("call, match", [
    (dict(pos=MS), "positions"), (dict(pos=-1), "positions"), (dict(pos=True), "pos0"),
    (dict(pos=3.0), "pos0"), (dict(q=np.float64), "q must be float32"),
    (dict(k_new=(2, HK, HD)), "k_new has 2 rows"), (dict(v_new=(1, HK, 64)), "v_new"),
    (dict(attn_sink=True), "attn_sink"), (dict(attn_sink=-1), "attn_sink"),
    (dict(kps=16.0), "kps"), (dict(splits_cap=0), "splits_cap"),
    (dict(scale=float("nan")), "scale"), (dict(softcap=-1.0), "softcap"),
    (dict(window_size=(8, -2)), "window right"), (dict(window_size=[8, True]), "window_size"),
])
def test_a_step_after_replays_is_checked_as_the_first(cp, full_steps, call, match):
    cache = _cache("q4")
    q, k1, v1 = _step(cp)
    for pos in (5, 6):
        cache.decode(q, k1, v1, pos, kps=16, splits_cap=4)
    launched, length = len(cp.launched), cache.length
    arrays = {"q": q, "k_new": k1, "v_new": v1}
    if "q" in call:
        arrays["q"] = cp.empty((H, HD), call.pop("q"))
    for name in ("k_new", "v_new"):
        if name in call:
            arrays[name] = cp.empty(call.pop(name))
    kw = {"pos": 7, "kps": 16, "splits_cap": 4, **call}
    with pytest.raises(ContractError, match=match):
        cache.decode(arrays["q"], arrays["k_new"], arrays["v_new"], **kw)
    assert len(cp.launched) == launched and cache.length == length


def test_a_changed_cache_is_noticed(cp, full_steps):
    cache = _cache("q4")
    q, k1, v1 = _step(cp)
    for pos in (5, 6):
        cache.decode(q, k1, v1, pos, kps=16, splits_cap=4)
    cache.win = 8
    cache.decode(q, k1, v1, 7, kps=16, splits_cap=4)
    name, _, _, args, _, _ = cp.launched[-3]
    assert full_steps[0] == 2 and "append" in name and args[-1] == np.int32(8)
    cache.k = cp.zeros(cache.k.shape, cache.k.dtype)
    cache.decode(q, k1, v1, 8, kps=16, splits_cap=4)
    assert full_steps[0] == 3 and cp.launched[-3][3][2] is cache.k


def test_the_tuned_plan_is_asked_every_step(cp, full_steps, monkeypatch):
    cache = _cache("f32")
    q, k1, v1 = _step(cp)
    kernel = cache.kernels.get("decode", H // HK)[0].name
    choice = tuned.Choice(kernel, "sha", 32, 8, 1.0)
    monkeypatch.setattr(tuned, "tuned", lambda *a: choice)
    for pos in (5, 6):
        cache.decode(q, k1, v1, pos)
        assert cache.last_plan == (32, 8, "tuned")
    monkeypatch.setattr(tuned, "tuned", lambda *a: None)
    # Untuned: the plan derived from the device (the fake is a K80 die) and the decode
    # kernel's block: default_plan of its schedule over HK kv heads.
    k = cache.kernels.get("decode", H // HK)[0]
    family = plan.family_registers(x for x, _ in generated())
    derived = plan.default_plan(TARGET.on_device(13), HK, block_threads(k, cache.head_dim),
                                plan.plan_registers(k, family),
                                plan.plan_shared_bytes(k, cache.head_dim), k.schedule)
    for pos in (7, 8):
        cache.decode(q, k1, v1, pos)
        assert cache.last_plan == (*derived, "default")
    assert full_steps[0] == 2
    monkeypatch.setattr(tuned, "tuned", lambda *a: tuned.Choice(kernel, "sha", 32.0, 8, 1.0))
    with pytest.raises(ContractError, match="kps"):
        cache.decode(q, k1, v1, 9)


def test_a_replay_swaps_arrays_by_argument_not_by_object(cp, full_steps):
    """k_new and v_new were one array when the step was derived, two after."""
    cache = _cache("f32")
    q, k1, _ = _step(cp)
    cache.decode(q, k1, k1, 5, kps=16, splits_cap=4)
    _, k2, v2 = _step(cp)
    cache.decode(q, k2, v2, 6, kps=16, splits_cap=4)
    args = cp.launched[-3][3]
    assert full_steps[0] == 1 and args[0] is k2 and args[1] is v2


def test_the_arrays_a_replay_keeps_are_checked_too(cp, full_steps):
    """A cache buffer changed in place (here: no longer contiguous) is a new
    signature: the step binds in full and the contract refuses it."""
    cache = _cache("f32")
    q, k1, v1 = _step(cp)
    for pos in (5, 6):
        cache.decode(q, k1, v1, pos, kps=16, splits_cap=4)
    launched = len(cp.launched)
    cache.k.strides = tuple(2 * s for s in cache.k.strides)
    with pytest.raises(ContractError, match="k_cache must be C-contiguous"):
        cache.decode(q, k1, v1, 7, kps=16, splits_cap=4)
    assert full_steps[0] == 2 and len(cp.launched) == launched
