"""The engine-owned paged path (kgen.runtime.engine) without a GPU: over the pages and
index tensors a PagedKVCache made, reshape_and_cache + paged_attention launch exactly the
cache's kernels with the cache's grids and scalars (so the GPU gives the same bits), the
metadata's checks refuse broken index tensors once, before anything launches, and int64
slot mappings are narrowed once a step."""

from __future__ import annotations

import numpy as np
import pytest

from kgen.runtime import (
    ContractError,
    PagedKVCache,
    PagedMetadata,
    paged_attention,
    reshape_and_cache,
    tuned,
)
from kgen.runtime import engine as eng
from kgen.testing.built import needs_build
from kgen.testing.fakecupy import FakeArray, Guarded
from kgen.testing.paged import step_tensors

pytestmark = needs_build
HK, HD, NB, BS = 2, 128, 16, 16


@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(tuned, "tuned", lambda *a: None)
    monkeypatch.setattr(tuned, "tuned_prefill", lambda *a: None)
    monkeypatch.setattr(eng, "_KERNELS", {})
    monkeypatch.setattr(eng, "_SCRATCH", {})
    return Guarded().install(monkeypatch)


def _scalars(launches) -> list:
    """Each launch by kernel, grid, block, shared memory and its non-array arguments."""
    return [(name, grid, block, smem,
             tuple((type(a).__name__, a.item()) for a in args if not isinstance(a, FakeArray)))
            for name, grid, block, args, smem, _ in launches]


def _host(cp, a, dtype=np.int32):
    return cp.asarray(np.asarray(a, dtype))


@pytest.mark.parametrize("kv, H", [("f32", 8), ("q8_0", 8), ("f16", 2), ("fp8_e4m3", 8)])
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_the_engine_launches_what_the_cache_launches(cp, kv, H, slot_dtype):
    """A prefill step, then a decode step: the cache's own calls, then the engine's over
    the cache's pages and the tensors it used, launch alike (kernels, grids, blocks,
    shared memory, scalars)."""
    scale = {"k_scale": 0.5, "v_scale": 0.25} if kv == "fp8_e4m3" else {}
    cache = PagedKVCache(NB, BS, HK, HD, kv=kv, **scale)
    sids = [cache.add(), cache.add(), cache.add()]
    for rows in ([5, 17, 1], [1, 1, 1]):
        T = sum(rows)
        q, kn, vn = cp.empty((T, H, HD)), cp.empty((T, HK, HD)), cp.empty((T, HK, HD))
        qsl, lens, table, slots = step_tensors(cache, sids, rows)
        meta = PagedMetadata(_host(cp, qsl), _host(cp, lens), _host(cp, table),
                             _host(cp, slots, slot_dtype), max(rows), int(lens.max()))
        mine = len(cp.launched)
        reshape_and_cache(kn, vn, cache.k, cache.v, meta, kv_cache_dtype=kv, **scale)
        paged_attention(q, cache.k, cache.v, meta, kv_cache_dtype=kv, **scale)
        engine = cp.launched[mine:]
        del cp.launched[mine:]
        (cache.prefill if max(rows) > 1 else cache.decode)(sids, q, kn, vn,
                                                           *([rows] if max(rows) > 1 else []))
        own = cp.launched[mine:]
        assert _scalars(engine) == _scalars(own), (rows, kv)
        assert len(own) >= 2


def test_int64_slots_are_narrowed_once_a_step(cp):
    cache = PagedKVCache(NB, BS, HK, HD, kv="f32")
    sid = cache.add()
    qsl, lens, table, slots = step_tensors(cache, [sid], [3])
    meta = PagedMetadata(_host(cp, qsl), _host(cp, lens), _host(cp, table),
                         _host(cp, slots, np.int64), 3, 3)
    assert meta.slot_mapping.dtype == np.int32
    assert meta.slot_mapping.host.tolist() == slots.tolist()
    k, v = cp.empty((3, HK, HD)), cp.empty((3, HK, HD))
    cp.armed, cp.touched = True, []
    for _ in range(4):  # layers: nothing converted or uploaded again
        reshape_and_cache(k, v, cache.k, cache.v, meta)
    cp.armed = False
    assert [t[0] for t in cp.touched] == ["launch"] * 4


def _meta_args(cp, qsl=(0, 2, 3), lens=(4, 1), table=((0, 1), (2, -1)), slots=(2, 3, 0),
               mq=2, ms=4):
    return (_host(cp, qsl), _host(cp, lens), _host(cp, table), _host(cp, slots), mq, ms)


@pytest.mark.parametrize("change, match", [
    (dict(qsl=(1, 2, 3)), "rise from 0"), (dict(qsl=(0, 3, 2)), "rise from 0"),
    (dict(qsl=(0, 2, 9)), "past the 3 slots"), (dict(mq=1), "above max_query_len"),
    (dict(lens=(1, 1)), "seq_lens must lie"), (dict(lens=(9, 1)), "seq_lens must lie"),
    (dict(ms=0), "max_seq_len"), (dict(mq=1.5), "max_query_len"),
    (dict(slots=((0, 1),)), "slot_mapping must be"), (dict(validate=2), "validate must be"),
])
def test_broken_metadata_is_refused_once_before_any_launch(cp, change, match):
    kw = {k: change.pop(k) for k in ("validate",) if k in change}
    args = _meta_args(cp, **change)
    cp.armed, cp.touched = True, []
    with pytest.raises(ContractError, match=match):
        PagedMetadata(*args, **kw)
    cp.armed = False
    assert [t for t in cp.touched if t[0] != "upload"] == []


def test_pages_outside_the_cache_are_refused_at_the_layer(cp):
    cache = PagedKVCache(4, 2, HK, HD, kv="f32")
    meta = PagedMetadata(*_meta_args(cp, table=((0, 1), (7, -1))))
    q = cp.empty((3, 4, HD))
    cp.armed, cp.touched = True, []
    with pytest.raises(ContractError, match="outside"):
        paged_attention(q, cache.k, cache.v, meta)
    cp.armed = False
    assert cp.touched == []
    ok = PagedMetadata(*_meta_args(cp))
    paged_attention(q, cache.k, cache.v, ok)  # the same step over pages that exist


def test_graph_capture_reads_nothing_back(cp):
    """Under a capture, validate=None trusts the tensors: nothing is read, the checks
    that need their values are skipped."""
    cp.capturing = 1
    meta = PagedMetadata(*_meta_args(cp, qsl=(5, 1, 0)))  # broken, but unread
    assert meta.validated is False
    cp.capturing = 0


def test_kv_cache_dtype_names():
    f32, u8 = FakeArray((1, 1, 1, 1)), FakeArray((1, 1, 1, 1), np.uint8)
    assert eng.kv_format("auto", f32) == "f32"
    assert eng.kv_format("fp8", u8) == "fp8_e4m3" and eng.kv_format("q8_0", u8) == "q8_0"
    for bad, pages in (("auto", u8), ("int4", f32), (None, f32)):
        with pytest.raises(ContractError) as e:
            eng.kv_format(bad, pages)
        assert e.value.contract == "kv_cache_dtype"


def test_metadata_must_be_the_engines(cp):
    cache = PagedKVCache(NB, BS, HK, HD, kv="f32")
    with pytest.raises(ContractError, match="PagedMetadata"):
        paged_attention(cp.empty((1, 4, HD)), cache.k, cache.v, {"seq_lens": None})


def test_a_step_plans_once_for_every_layer(cp):
    """The decode kernels and plan are derived once a step (the metadata keeps them per
    layer shape); a scale that is no number is refused, not cached."""
    cache = PagedKVCache(NB, BS, HK, HD, kv="f32")
    sids = [cache.add(), cache.add()]
    qsl, lens, table, slots = step_tensors(cache, sids, [1, 1])
    meta = PagedMetadata(_host(cp, qsl), _host(cp, lens), _host(cp, table),
                         _host(cp, slots), 1, int(lens.max()))
    q = cp.empty((2, 8, HD))
    for _ in range(3):
        paged_attention(q, cache.k, cache.v, meta)
    assert len(meta.plans) == 1
    with pytest.raises(ContractError) as e:
        paged_attention(q, cache.k, cache.v, meta, k_scale=[1.0])
    assert e.value.contract == "scales"
