"""The high-level API on a GPU: KV caches, chunked q4 prefill, decode as split
+ combine, device-position decode under CUDA-graph replay, multi-user slots,
and launches refused before they reach the GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.runtime import ContractError, decode_plan
from kgen.testing import rng

pytestmark = pytest.mark.gpu
RTOL, ATOL = 2e-4, 2e-5


@pytest.fixture
def cp():
    import cupy

    return cupy


def _rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def test_f32_cache_prefill_then_decode(cp):
    from kgen.runtime.kv import KVCache

    g, seed = rng()
    hk, H, hd, ms = 2, 8, 256, 128
    cache = KVCache(hk, hd, ms)
    n = 45
    q, kn, vn = _rand(g, n, H, hd), _rand(g, n, hk, hd), _rand(g, n, hk, hd)
    out = cache.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0)
    kref, vref = ref.empty_f32_cache(hk, ms, hd)
    ref.kv_append(kn, vn, kref, vref, 0)
    want = ref.prefill_attention(q, kref, vref, H // hk, 0, 0, 0, 1 / math.sqrt(hd))
    np.testing.assert_allclose(out.get(), want, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")

    qd, kd, vd = _rand(g, H, hd), _rand(g, 1, hk, hd), _rand(g, 1, hk, hd)
    got = cache.decode(cp.asarray(qd), cp.asarray(kd), cp.asarray(vd), pos=n, kps=16,
                       splits_cap=4)
    ref.kv_append(kd, vd, kref, vref, n)
    want = ref.decode_attention(qd, kref, vref, H // hk, n + 1, 16, 4, 0, 0, 1 / math.sqrt(hd))
    np.testing.assert_allclose(got.get(), want, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")


def test_q4_prefill_is_chunked_so_the_window_ring_is_never_lapped(cp):
    """A 300-row batch with win = 200 would lap the 256-row ring; the cache splits
    it so every row reads its whole window from fp16 (the live floor never fires)."""
    from kgen.runtime.kv import KVCache

    g, seed = rng()
    hk, H, hd, ms, sink, win = 1, 2, 256, 320, 4, 200
    cache = KVCache(hk, hd, ms, kv="q4", sink=sink, win=win)
    step = cache.max_prefill_chunk()
    assert step == 57
    n = 300
    q, kn, vn = _rand(g, n, H, hd), _rand(g, n, hk, hd), _rand(g, n, hk, hd)
    out = cache.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0).get()
    host = ref.Q4Cache.empty(hk, ms, hd)
    scale = 1 / math.sqrt(hd)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        ref.kv_append_q4(kn[lo:hi], vn[lo:hi], host, lo, sink, win)
        want = ref.prefill_attention_q4(q[lo:hi], host, H // hk, lo, sink, win, 0, 0, scale,
                                        live_floor=False)
        np.testing.assert_allclose(out[lo:hi], want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"rows {lo}:{hi} seed={seed}")
    for name, rows in (("k", n), ("v", n), ("k_sink", sink), ("v_sink", sink)):
        got = getattr(cache, name).get()[:, :rows]
        assert np.array_equal(got.view(np.uint8), getattr(host, name)[:, :rows].view(np.uint8)), \
            f"{name} rows differ from the reference append, seed={seed}"


@pytest.mark.parametrize("kv", ["f32", "q4"])
def test_device_position_decode_replays_in_a_cuda_graph(cp, kv):
    """Capture decode_device once; replaying it at later positions equals the
    host-plan decode bit for bit (the device plan is the host plan)."""
    from kgen.runtime.kv import KVCache

    g, seed = rng()
    hk, H, hd, ms = 2, 4, 256, 400
    kw = dict(kps=32, splits_cap=8)
    graphed = KVCache(hk, hd, ms, kv=kv, sink=4, win=32)
    direct = KVCache(hk, hd, ms, kv=kv, sink=4, win=32)
    n0 = 100
    kn, vn = _rand(g, n0, hk, hd), _rand(g, n0, hk, hd)
    for c in (graphed, direct):
        c.prefill(cp.asarray(_rand(g, n0, H, hd)), cp.asarray(kn), cp.asarray(vn), pos0=0)
    pos = cp.zeros(1, cp.int32)
    q, k1, v1 = (cp.zeros((H, hd), cp.float32), cp.zeros((1, hk, hd), cp.float32),
                 cp.zeros((1, hk, hd), cp.float32))
    out = cp.zeros((H, hd), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    pos.fill(n0)
    graphed.decode_device(q, k1, v1, pos, out=out, **kw)  # warm-up: loads the modules
    with stream:
        stream.begin_capture()
        graphed.decode_device(q, k1, v1, pos, out=out, validate_pos=False, stream=stream, **kw)
        graph = stream.end_capture()
    for p in (n0, n0 + 1, n0 + 57, n0 + 200):
        qh, kh, vh = _rand(g, H, hd), _rand(g, 1, hk, hd), _rand(g, 1, hk, hd)
        q.set(qh), k1.set(kh), v1.set(vh)
        pos.fill(p)
        out.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        want = direct.decode(cp.asarray(qh), cp.asarray(kh), cp.asarray(vh), pos=p, **kw)
        assert decode_plan(p + 1, 32, 8).n_splits >= 1
        assert np.array_equal(out.get().view(np.uint32), want.get().view(np.uint32)), \
            f"graph replay at pos {p} differs from the direct decode, seed={seed}"


@pytest.mark.parametrize("kv", ["f32", "q4"])
def test_slot_decode_matches_per_user_reference(cp, kv):
    from kgen.runtime.kv import SlotKVCache

    g, seed = rng()
    ns, hk, H, hd, ms, sink, win = 3, 2, 4, 256, 300, 4, 64
    cache = SlotKVCache(ns, hk, hd, ms, kv=kv, sink=sink, win=win)
    scale = 1 / math.sqrt(hd)
    host_f32 = ref.empty_f32_cache(hk, ms, hd, nslots=ns)
    host_q4 = ref.Q4Cache.empty(hk, ms, hd, nslots=ns)
    lengths = [5, 130, 260]
    for step in range(max(lengths)):
        active = [u for u in range(ns) if step < lengths[u]]
        if not active:
            break
        pos = [min(step, lengths[u] - 1) for u in range(ns)]
        q = _rand(g, ns, H, hd)
        kn, vn = _rand(g, ns, hk, hd), _rand(g, ns, hk, hd)
        if any(step == lengths[u] - 1 for u in range(ns)) or step in (0, 64):
            got = cache.decode(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos, kps=32,
                               splits_cap=8).get()
            p = np.array(pos, np.int32)
            if kv == "f32":
                ref.kv_append_slots(kn, vn, *host_f32, p)
                want = ref.decode_attention_slots(q, host_f32[0], host_f32[1], p, H // hk, 32,
                                                  8, 0, 0, scale)
            else:
                ref.kv_append_slots_q4(kn, vn, host_q4, p, sink, win)
                want = ref.decode_attention_slots(
                    q, lambda u, p=p: ref.read_kv_rows_q4(host_q4.slot(u), int(p[u]), sink, win),
                    None, p, H // hk, 32, 8, 0, 0, scale)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                                       err_msg=f"step {step} seed={seed}")
        else:
            cache.decode(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos, kps=32,
                         splits_cap=8)
            p = np.array(pos, np.int32)
            if kv == "f32":
                ref.kv_append_slots(kn, vn, *host_f32, p)
            else:
                ref.kv_append_slots_q4(kn, vn, host_q4, p, sink, win)


def test_host_arrays_are_refused_before_launch(cp):
    import kgen_kernels as kk

    z = np.zeros((2, 2, 256), np.float32)
    with pytest.raises(ContractError, match="cupy array"):
        kk.fc_attn_kv_append(z, z, np.zeros((2, 8, 256), np.float32),
                             np.zeros((2, 8, 256), np.float32), pos0=0)


def test_a_broken_contract_leaves_outputs_untouched(cp):
    import kgen_kernels as kk

    q = cp.ones((4, 2, 128), cp.float32)  # head_dim 128 < 256: not every key is scored
    kc = cp.ones((2, 16, 128), cp.float32)
    out = cp.full((4, 2, 128), np.nan, cp.float32)
    with pytest.raises(ContractError, match="every key scored"):
        kk.fc_attn_flash_prefill(q, kc, kc, out, pos0=0)
    assert bool(cp.isnan(out).all())


def test_a_long_q4_append_is_split_into_ring_sized_launches(cp):
    """600 rows with a window: one launch would race two blocks per ring slot, so
    the cache appends in launches of at most RING_ROWS rows; the result is what
    appending in order leaves (each ring slot holds its newest position)."""
    from kgen.runtime.kv import KVCache

    g, seed = rng()
    hk, hd, ms, sink, win = 2, 256, 700, 8, 64
    cache = KVCache(hk, hd, ms, kv="q4", sink=sink, win=win)
    kn, vn = _rand(g, 600, hk, hd), _rand(g, 600, hk, hd)
    cache.append(cp.asarray(kn), cp.asarray(vn), pos0=0)
    host = ref.Q4Cache.empty(hk, ms, hd)
    for lo in range(0, 600, 256):
        ref.kv_append_q4(kn[lo:lo + 256], vn[lo:lo + 256], host, lo, sink, win)
    for name, rows in (("k", 600), ("v", 600), ("k_win", 256), ("v_win", 256),
                       ("k_sink", sink)):
        got = getattr(cache, name).get()[:, :rows]
        assert np.array_equal(got.view(np.uint8), getattr(host, name)[:, :rows].view(np.uint8)), \
            f"{name} differs, seed={seed}"


@pytest.mark.parametrize("kv", ["f32", "q4"])
def test_slot_prefill_then_decode(cp, kv):
    """Users prefill prompts of different lengths into their own rings (a slot is a
    single-sequence cache view), then decode together at their own positions."""
    from kgen.runtime.kv import SlotKVCache

    g, seed = rng()
    ns, hk, H, hd, ms, sink, win = 2, 2, 4, 256, 400, 4, 64
    cache = SlotKVCache(ns, hk, hd, ms, kv=kv, sink=sink, win=win)
    scale = 1 / math.sqrt(hd)
    host_f32 = ref.empty_f32_cache(hk, ms, hd, nslots=ns)
    host_q4 = ref.Q4Cache.empty(hk, ms, hd, nslots=ns)
    lengths = [37, 300]
    for u, n in enumerate(lengths):
        q, kn, vn = _rand(g, n, H, hd), _rand(g, n, hk, hd), _rand(g, n, hk, hd)
        out = cache.prefill(u, cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0).get()
        if kv == "f32":
            ref.kv_append(kn, vn, host_f32[0][u], host_f32[1][u], 0)
            want = ref.prefill_attention(q, host_f32[0][u], host_f32[1][u], H // hk, 0, 0, 0,
                                         scale)
            np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")
        else:
            step = cache.slot(u).max_prefill_chunk()
            for lo in range(0, n, step):
                hi = min(lo + step, n)
                ref.kv_append_q4(kn[lo:hi], vn[lo:hi], host_q4.slot(u), lo, sink, win)
                want = ref.prefill_attention_q4(q[lo:hi], host_q4.slot(u), H // hk, lo, sink,
                                                win, 0, 0, scale)
                np.testing.assert_allclose(out[lo:hi], want, rtol=RTOL, atol=ATOL,
                                           err_msg=f"slot {u} rows {lo}:{hi} seed={seed}")
    q = _rand(g, ns, H, hd)
    kn, vn = _rand(g, ns, hk, hd), _rand(g, ns, hk, hd)
    got = cache.decode(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), lengths, kps=32,
                       splits_cap=8).get()
    p = np.array(lengths, np.int32)
    if kv == "f32":
        ref.kv_append_slots(kn, vn, *host_f32, p)
        want = ref.decode_attention_slots(q, host_f32[0], host_f32[1], p, H // hk, 32, 8, 0, 0,
                                          scale)
    else:
        ref.kv_append_slots_q4(kn, vn, host_q4, p, sink, win)
        want = ref.decode_attention_slots(
            q, lambda u: ref.read_kv_rows_q4(host_q4.slot(u), int(p[u]), sink, win), None, p,
            H // hk, 32, 8, 0, 0, scale)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")
