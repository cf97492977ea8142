"""The high-level API on a GPU, for every registered KV format: KV caches with
kernels chosen by axes, chunked prefill, decode as split kernel + combine, the
device-position decode replayed in a CUDA graph, slots, and refusals that
leave outputs untouched. Each case compares with the float64 NumPy reference
over the rows the kernels read (kgen.numpy_ref, through each format's model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.formats import FORMATS
from kgen.ir.axes import Op
from kgen.runtime import ContractError
from kgen.runtime.kv import ROLES
from kgen.runtime.select import Role, generated
from kgen.testing import rng

pytestmark = pytest.mark.gpu
RTOL, ATOL = 2e-4, 2e-5
HD = 256  # a head_dim every reference kernel serves


def _served(*roles: str) -> list[str]:
    """Formats whose generated kernels cover every role named (from the package)."""
    ks = [k for k, _ in generated()]
    out = []
    for kv in FORMATS:
        def has(r, kv=kv):
            b = ROLES[r]
            role = Role(b.op, b.position, b.mode, kv if b.op in (Op.FLASH, Op.KV_APPEND)
                        else None)
            return any(role.matches(k) for k in ks)
        if all(has(r) for r in roles):
            out.append(kv)
    return out


def _shadows(kv: str, sink: int, win: int) -> tuple[int, int]:
    return (sink, win) if FORMATS[kv].shadows else (0, 0)


@pytest.fixture
def cp():
    import cupy

    return cupy


def _rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def _host(cache) -> ref.HostCache:
    return ref.HostCache.empty(cache.fmt, cache.n_head_kv, cache.max_seq, cache.head_dim,
                               cache.RING_ROWS, cache.SINK_ROWS)


@pytest.mark.parametrize("kv", _served("append", "prefill", "decode", "combine"))
def test_cache_prefill_then_decode(cp, kv):
    """Chunked prefill (a shadowed format's window ring is never lapped), then
    decode steps, against the reference over the rows each kernel reads."""
    from kgen.runtime.kv import KVCache

    g, seed = rng()
    hk, H, hd, ms = 2, 8, HD, 400
    sink, win = _shadows(kv, 4, 200)
    cache = KVCache(hk, hd, ms, kv=kv, sink=sink, win=win)
    host = _host(cache)
    scale = 1 / math.sqrt(hd)
    n = 300
    q, kn, vn = _rand(g, n, H, hd), _rand(g, n, hk, hd), _rand(g, n, hk, hd)
    got = cache.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0).get()
    step = cache.max_prefill_chunk()
    kp = cache.kernels.get("prefill", H // hk)[0]
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        ref.append(kn[lo:hi], vn[lo:hi], host, lo, sink, win)
        floor = (ref.prefill_live_floor(lo, hi - lo, cache.RING_ROWS)
                 if kp.ring_floor.value == "batch" else None)
        want = ref.prefill_attention_cache(q[lo:hi], host, H // hk, lo, sink, win, 0, 0, scale,
                                           floor, tile=kp.tile_keys)
        np.testing.assert_allclose(got[lo:hi], want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{kv} prefill rows {lo}..{hi} seed={seed}")
    kd = cache.kernels.get("decode", H // hk)[0]
    for pos in (n, n + 1, n + 2):
        qd, kd1, vd1 = _rand(g, H, hd), _rand(g, 1, hk, hd), _rand(g, 1, hk, hd)
        got = cache.decode(cp.asarray(qd), cp.asarray(kd1), cp.asarray(vd1), pos=pos, kps=64,
                           splits_cap=4).get()
        ref.append(kd1, vd1, host, pos, sink, win)
        kr, vr = ref.read_kv_rows(host, pos, sink, win)
        want = ref.decode_attention(qd, kr, vr, H // hk, pos + 1, 64, 4, 0, 0, scale,
                                    tile=kd.tile_keys)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{kv} decode at {pos} seed={seed}")


@pytest.mark.parametrize("kv", _served("append_dev", "decode_dev", "combine_dev", "decode",
                                       "combine", "prefill"))
def test_device_position_decode_replays_in_a_cuda_graph(cp, kv):
    """Capture decode_device once; replaying it at later positions equals the
    host-plan decode bit for bit (the device plan is the host plan)."""
    from kgen.runtime.kv import KVCache

    g, seed = rng()
    hk, H, hd, ms = 2, 4, HD, 400
    sink, win = _shadows(kv, 4, 32)
    kw = dict(kps=32, splits_cap=8)
    graphed = KVCache(hk, hd, ms, kv=kv, sink=sink, win=win)
    direct = KVCache(hk, hd, ms, kv=kv, sink=sink, win=win)
    n0 = 100
    kn, vn = _rand(g, n0, hk, hd), _rand(g, n0, hk, hd)
    qp = _rand(g, n0, H, hd)
    for c in (graphed, direct):
        c.prefill(cp.asarray(qp), cp.asarray(kn), cp.asarray(vn), pos0=0)
    pos = cp.zeros(1, cp.int32)
    q, k1, v1 = (cp.zeros((H, hd), cp.float32), cp.zeros((1, hk, hd), cp.float32),
                 cp.zeros((1, hk, hd), cp.float32))
    out = cp.zeros((H, hd), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    pos.fill(n0)
    graphed.decode_device(q, k1, v1, pos, out=out, **kw)  # warm-up: loads the modules
    with stream:
        stream.begin_capture()
        graphed.decode_device(q, k1, v1, pos, out=out, stream=stream, **kw)  # capturing: unread
        graph = stream.end_capture()
    cp.cuda.Device().synchronize()  # the warm-up (legacy stream) is done before the replays
    for p in (n0, n0 + 1, n0 + 57, n0 + 200):
        qh, kh, vh = _rand(g, H, hd), _rand(g, 1, hk, hd), _rand(g, 1, hk, hd)
        with stream:  # the inputs are set in the order of the stream the graph replays on
            q.set(qh), k1.set(kh), v1.set(vh)
            pos.fill(p)
            out.fill(np.nan)
            graph.launch(stream)
        stream.synchronize()
        want = direct.decode(cp.asarray(qh), cp.asarray(kh), cp.asarray(vh), pos=p, **kw)
        assert np.array_equal(out.get().view(np.uint32), want.get().view(np.uint32)), \
            f"{kv}: graph replay at pos {p} differs from the direct decode, seed={seed}"


@pytest.mark.parametrize("kv", _served("append_slots", "decode_slots", "combine"))
def test_slot_decode_matches_per_user_reference(cp, kv):
    from kgen.runtime.kv import SlotKVCache

    g, seed = rng()
    ns, hk, H, hd, ms = 3, 2, 4, HD, 300
    sink, win = _shadows(kv, 4, 64)
    cache = SlotKVCache(ns, hk, hd, ms, kv=kv, sink=sink, win=win)
    kd = cache.kernels.get("decode_slots", H // hk)[0]
    scale = 1 / math.sqrt(hd)
    host = ref.HostCache.empty(cache.fmt, hk, ms, hd, cache.RING_ROWS, cache.SINK_ROWS,
                               nslots=ns)
    lengths = [5, 130, 260]
    for step in range(max(lengths)):
        pos = [min(step, lengths[u] - 1) for u in range(ns)]
        q = _rand(g, ns, H, hd)
        kn, vn = _rand(g, ns, hk, hd), _rand(g, ns, hk, hd)
        got = cache.decode(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos, kps=32,
                           splits_cap=8)
        p = np.array(pos, np.int32)
        ref.append_slots(kn, vn, host, p, sink, win)
        if any(step == lengths[u] - 1 for u in range(ns)) or step in (0, 64):
            want = ref.decode_attention_slots(
                q, lambda u, p=p: ref.read_kv_rows(host.slot(u), int(p[u]), sink, win),
                None, p, H // hk, 32, 8, 0, 0, scale, tile=kd.tile_keys)
            np.testing.assert_allclose(got.get(), want, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{kv} step {step} seed={seed}")


@pytest.mark.parametrize("kv", _served("append", "prefill"))
def test_slot_prefill_then_decode(cp, kv):
    """One user's prompt through its slot's view, then a slots decode step."""
    from kgen.runtime.kv import SlotKVCache

    if kv not in _served("append_slots", "decode_slots", "combine"):
        pytest.skip(f"no slots kernels for {kv}")
    g, seed = rng()
    ns, hk, H, hd, ms = 2, 2, 4, HD, 200
    sink, win = _shadows(kv, 4, 64)
    cache = SlotKVCache(ns, hk, hd, ms, kv=kv, sink=sink, win=win)
    host = ref.HostCache.empty(cache.fmt, hk, ms, hd, cache.RING_ROWS, cache.SINK_ROWS,
                               nslots=ns)
    n = 90
    for u in range(ns):
        q, kn, vn = _rand(g, n, H, hd), _rand(g, n, hk, hd), _rand(g, n, hk, hd)
        cache.prefill(u, cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0)
        ref.append(kn, vn, host.slot(u), 0, sink, win)
    q, kn, vn = _rand(g, ns, H, hd), _rand(g, ns, hk, hd), _rand(g, ns, hk, hd)
    got = cache.decode(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), [n, n], kps=32,
                       splits_cap=8).get()
    p = np.array([n, n], np.int32)
    ref.append_slots(kn, vn, host, p, sink, win)
    kd = cache.kernels.get("decode_slots", H // hk)[0]
    want = ref.decode_attention_slots(
        q, lambda u: ref.read_kv_rows(host.slot(u), n, sink, win), None, p, H // hk, 32, 8,
        0, 0, 1 / math.sqrt(hd), tile=kd.tile_keys)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"{kv} seed={seed}")


@pytest.mark.parametrize("kv", _served("append"))
def test_a_long_append_is_split_into_ring_sized_launches(cp, kv):
    """600 rows: with a window ring, one launch would race two blocks per ring slot,
    so the cache appends in launches of at most RING_ROWS rows; the result is what
    appending in order leaves (each ring slot holds its newest position)."""
    from kgen.runtime.kv import KVCache

    g, seed = rng()
    hk, hd, ms = 2, HD, 700
    sink, win = _shadows(kv, 8, 64)
    cache = KVCache(hk, hd, ms, kv=kv, sink=sink, win=win)
    kn, vn = _rand(g, 600, hk, hd), _rand(g, 600, hk, hd)
    cache.append(cp.asarray(kn), cp.asarray(vn), pos0=0)
    host = _host(cache)
    step = cache.RING_ROWS or 600
    for lo in range(0, 600, step):
        ref.append(kn[lo:lo + step], vn[lo:lo + step], host, lo, sink, win)
    names = ["k", "v", *host.shadows]
    for name, got, want in zip(names, [cache.k, cache.v, *cache.shadows], host.arrays,
                               strict=True):
        rows = min(600, want.shape[-2])
        assert np.array_equal(got.get()[:, :rows].view(np.uint8),
                              want[:, :rows].view(np.uint8)), \
            f"{kv} {name} rows differ from the reference append, seed={seed}"


def test_host_arrays_are_refused_before_launch(cp):
    k, fn = next((k, f) for k, f in generated() if k.op is Op.KV_APPEND
                 and k.position.value == "host" and k.kv.value == "f32")
    z = np.zeros((2, 2, HD), np.float32)
    with pytest.raises(ContractError, match="cupy array"):
        fn(z, z, np.zeros((2, 8, HD), np.float32), np.zeros((2, 8, HD), np.float32), pos0=0)


def test_a_broken_contract_leaves_state_untouched(cp):
    """A launcher refusal writes nothing; a KVCache refusal neither appends nor
    advances the length."""
    from kgen.runtime.kv import KVCache

    cache = KVCache(2, HD, 16, kv="f32")
    out_before = cache.k.copy()
    q = cp.ones((4, 8, HD), cp.float32)
    with pytest.raises(ContractError):
        cache.decode(cp.ones((8, HD + 32), cp.float32), cp.ones((1, 2, HD), cp.float32),
                     cp.ones((1, 2, HD), cp.float32), pos=3)
    with pytest.raises(ContractError):
        cache.decode(cp.ones((8, HD), cp.float32), cp.ones((1, 2, HD), cp.float32),
                     cp.ones((1, 2, HD), cp.float32), pos=16)
    with pytest.raises(ContractError):
        cache.prefill(q.astype(cp.float64), cp.ones((4, 2, HD), cp.float32),
                      cp.ones((4, 2, HD), cp.float32), pos0=0)
    assert cache.length == 0 and bool((cache.k == out_before).all())
    kp, fn = cache.kernels.get("prefill", 4)
    out = cp.full((4, 8, HD), np.nan, cp.float32)
    with pytest.raises(ContractError, match="no ring wrap"):  # rows [13, 17) of 16
        fn(q, cache.k, cache.v, out, pos0=13)
    assert bool(cp.isnan(out).all()) and bool((cache.k == out_before).all())


def _bytes(cache) -> list[bytes]:
    """Every byte a cache holds: its body and its shadows."""
    return [b.get().tobytes() for b in (cache.k, cache.v, *cache.shadows)]


def _other_device(cp, a):
    """``a`` copied to device 1, or None on a host with one GPU."""
    if cp.cuda.runtime.getDeviceCount() < 2:
        return None
    with cp.cuda.Device(1):
        return cp.asarray(a.get())


@pytest.mark.parametrize("kv", ["f32", "q4"])
def test_every_cache_refusal_comes_before_any_change(cp, kv):
    """Each refusal issue 19 found after a state change: a host or strided q, host
    sinks, a non-bool causal, decode_device at pos = max_seq (an f32 append wraps to
    row 0), a pos_dev of two entries, an out one column too wide. Each is a
    ContractError, and the cache's bytes and length are those before it."""
    from kgen.runtime.kv import KVCache

    g, seed = rng()
    hk, H, ms = 2, 8, 64
    sink, win = _shadows(kv, 4, 16)
    cache = KVCache(hk, HD, ms, kv=kv, sink=sink, win=win)

    def dev(*shape):
        return cp.asarray(_rand(g, *shape))

    cache.prefill(dev(10, H, HD), dev(10, hk, HD), dev(10, hk, HD), pos0=0)
    before = _bytes(cache)
    q6, k6, v6 = dev(6, H, HD), dev(6, hk, HD), dev(6, hk, HD)
    q1, k1, v1 = dev(H, HD), dev(1, hk, HD), dev(1, hk, HD)
    strided = cp.asarray(_rand(g, H, 2 * HD))[:, ::2]
    calls = {
        "prefill host q": lambda: cache.prefill(q6.get(), k6, v6, pos0=10),
        "prefill host sinks": lambda: cache.prefill(q6, k6, v6, pos0=10,
                                                    sinks=np.zeros(H, np.float32)),
        "prefill causal='no'": lambda: cache.prefill(q6, k6, v6, pos0=10, causal="no"),
        "decode host q": lambda: cache.decode(q1.get(), k1, v1, 10),
        "decode strided q": lambda: cache.decode(strided, k1, v1, 10),
        "decode host sinks": lambda: cache.decode(q1, k1, v1, 10,
                                                  sinks=np.zeros(H, np.float32)),
        "decode_device pos = max_seq": lambda: cache.decode_device(
            q1, k1, v1, cp.full(1, ms, cp.int32)),
        "decode_device pos_dev (2,)": lambda: cache.decode_device(
            q1, k1, v1, cp.full(2, 10, cp.int32)),
        "decode_device out too wide": lambda: cache.decode_device(
            q1, k1, v1, cp.full(1, 10, cp.int32), out=cp.zeros((H, HD + 1), cp.float32)),
        "decode_device host q": lambda: cache.decode_device(
            q1.get(), k1, v1, cp.full(1, 10, cp.int32)),
    }
    other = _other_device(cp, q6)
    if other is not None:
        calls["prefill q on device 1"] = lambda: cache.prefill(other, k6, v6, pos0=10)
    for name, call in calls.items():
        with pytest.raises(ContractError):
            call()
        cp.cuda.Device().synchronize()
        assert cache.length == 10 and _bytes(cache) == before, \
            f"{kv}: {name} changed the cache before refusing, seed={seed}"


def test_slot_refusals_come_before_any_change(cp):
    """SlotKVCache.decode with a strided q (it appended first) and prefill of a slot out
    of range (an IndexError) are ContractErrors that leave every ring as it was."""
    from kgen.runtime.kv import SlotKVCache

    g, seed = rng()
    hk, H, ms = 2, 8, 64
    slots = SlotKVCache(3, hk, HD, ms, kv="f32")
    before = _bytes(slots)
    rows = cp.asarray(_rand(g, 3, hk, HD))
    strided = cp.asarray(_rand(g, 3, H, 2 * HD))[..., ::2]
    with pytest.raises(ContractError, match="contiguous"):
        slots.decode(strided, rows, rows, [1, 2, 3])
    with pytest.raises(ContractError, match="slot"):
        slots.prefill(3, cp.asarray(_rand(g, 2, H, HD)), rows[:2], rows[:2], 0)
    cp.cuda.Device().synchronize()
    assert _bytes(slots) == before, f"a refused slot call wrote a ring, seed={seed}"


def _head_dims(kv: str) -> list[int]:
    from kgen.testing.testgen import MODEL_HEAD_DIMS

    return [hd for hd in MODEL_HEAD_DIMS if FORMATS[kv].accepts_head_dim(hd)]


@pytest.mark.parametrize("kv,hd", [(kv, hd) for kv in FORMATS for hd in _head_dims(kv)])
def test_every_model_head_size_without_naming_a_kernel(cp, kv, hd):
    """KVCache at each model head size: prefill, decode and device-position decode,
    kernels chosen by shape; decode matches the reference and the device-position
    form matches the host-plan decode bit for bit."""
    from kgen.runtime.kv import KVCache

    g, seed = rng()
    hk, H, ms, n = 2, 16, 160, 70
    sink, win = _shadows(kv, 4, 48)
    cache = KVCache(hk, hd, ms, kv=kv, sink=sink, win=win)
    twin = KVCache(hk, hd, ms, kv=kv, sink=sink, win=win)
    host = _host(cache)
    scale = 1 / math.sqrt(hd)
    q, kn, vn = _rand(g, n, H, hd), _rand(g, n, hk, hd), _rand(g, n, hk, hd)
    got = cache.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0).get()
    twin.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0)
    ref.append(kn, vn, host, 0, sink, win)
    kp = cache.kernels.get("prefill", H // hk)[0]
    floor = (ref.prefill_live_floor(0, n, cache.RING_ROWS)
             if kp.ring_floor.value == "batch" else None)
    want = ref.prefill_attention_cache(q, host, H // hk, 0, sink, win, 0, 0, scale, floor,
                                       tile=kp.tile_keys)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                               err_msg=f"{kv} hd{hd} prefill ({kp.name}) seed={seed}")
    kd = cache.kernels.get("decode", H // hk)[0]
    pos_dev = cp.zeros(1, cp.int32)
    for pos in (n, n + 1):
        qd, k1, v1 = _rand(g, H, hd), _rand(g, 1, hk, hd), _rand(g, 1, hk, hd)
        out = cache.decode(cp.asarray(qd), cp.asarray(k1), cp.asarray(v1), pos=pos, kps=32,
                           splits_cap=4).get()
        pos_dev.fill(pos)
        dev = twin.decode_device(cp.asarray(qd), cp.asarray(k1), cp.asarray(v1), pos_dev,
                                 kps=32, splits_cap=4).get()
        ref.append(k1, v1, host, pos, sink, win)
        kr, vr = ref.read_kv_rows(host, pos, sink, win)
        want = ref.decode_attention(qd, kr, vr, H // hk, pos + 1, 32, 4, 0, 0, scale,
                                    tile=kd.tile_keys)
        np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{kv} hd{hd} decode ({kd.name}) seed={seed}")
        assert np.array_equal(out.view(np.uint32), dev.view(np.uint32)), \
            f"{kv} hd{hd}: device-position decode differs from the host plan, seed={seed}"


def test_no_kernel_for_a_shape_is_a_clear_error(cp):
    from kgen.runtime.kv import KVCache

    blocked = next(kv for kv, f in FORMATS.items() if f.block > 1)
    cache_hd = next(hd for hd in range(40, 1024, 8) if not FORMATS[blocked].accepts_head_dim(hd))
    with pytest.raises(ContractError, match="head_dim"):
        KVCache(2, cache_hd, 64, kv=blocked)


OPTIONS = [
    {},
    {"window_size": (37, 0)},
    {"window_size": (0, 0), "attn_sink": 4},
    {"softcap": 1.5},
    {"sinks": True},
    {"window_size": (20, 0), "softcap": 2.0, "sinks": True, "attn_sink": 2},
]


@pytest.mark.parametrize("kv", _served("append", "prefill", "decode", "combine"))
@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_engine_options_through_the_cache(cp, kv, opt):
    """KVCache prefill then decode with each option on (kernels chosen by what the
    call asks for), against the reference; and the same options at their neutral
    values give the plain kernels' bits."""
    from kgen.runtime.kv import KVCache

    g, seed = rng()
    hk, H, hd, ms, n = 2, 8, HD, 200, 90
    sink, win = _shadows(kv, 4, 100)
    cache = KVCache(hk, hd, ms, kv=kv, sink=sink, win=win)
    host = _host(cache)
    scale = 1 / math.sqrt(hd)
    sinks = (_rand(g, H) * 2) if opt.get("sinks") else None
    kw = {k: v for k, v in opt.items() if k != "sinks"}
    dev_kw = {**kw, **({"sinks": cp.asarray(sinks)} if sinks is not None else {})}
    q, kn, vn = _rand(g, n, H, hd), _rand(g, n, hk, hd), _rand(g, n, hk, hd)
    try:
        got = cache.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0,
                            **dev_kw).get()
    except ContractError as exc:
        pytest.skip(f"no {kv} kernel with these options: {exc}")
    ref.append(kn, vn, host, 0, sink, win)
    kp = cache.kernels.get("prefill", H // hk, needs=_needs(cache, opt, "prefill"))[0]
    floor = (ref.prefill_live_floor(0, n, cache.RING_ROWS)
             if kp.ring_floor.value == "batch" else None)
    want = ref.prefill_attention_cache(q, host, H // hk, 0, sink, win, kw.get("attn_sink", 0),
                                       0, scale, floor, tile=kp.tile_keys,
                                       window=kw.get("window_size"), softcap=kw.get("softcap", 0),
                                       sinks=sinks)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                               err_msg=f"{kv} {opt} prefill ({kp.name}) seed={seed}")
    qd, k1, v1 = _rand(g, H, hd), _rand(g, 1, hk, hd), _rand(g, 1, hk, hd)
    got = cache.decode(cp.asarray(qd), cp.asarray(k1), cp.asarray(v1), pos=n, kps=32,
                       splits_cap=4, **dev_kw).get()
    ref.append(k1, v1, host, n, sink, win)
    kr, vr = ref.read_kv_rows(host, n, sink, win)
    kd = cache.kernels.get("decode_dev", H // hk, needs=_needs(cache, opt, "decode_dev"))[0]
    want = ref.decode_attention(qd, kr, vr, H // hk, n + 1, 32, 4, kw.get("attn_sink", 0), 0,
                                scale, tile=kd.tile_keys, sinks=sinks, window=kw.get("window_size"),
                                softcap=kw.get("softcap", 0))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                               err_msg=f"{kv} {opt} decode ({kd.name}) seed={seed}")


def _needs(cache, opt, role):
    from kgen.runtime.kv import Options

    return Options(window=opt.get("window_size"), softcap=opt.get("softcap", 0.0),
                   sinks=True if opt.get("sinks") else None).needs(role)


@pytest.mark.parametrize("kv", _served("append", "prefill"))
def test_neutral_options_are_the_plain_path_bit_for_bit(cp, kv):
    """The gate: an exact window that covers everything, soft-cap 0 and sinks of
    -inf give the plain kernels' bits (prefill and decode through the cache)."""
    from kgen.runtime.kv import INT_MAX, KVCache

    g, seed = rng()
    hk, H, hd, ms, n = 2, 8, HD, 160, 70
    sink, win = _shadows(kv, 4, 64)
    q, kn, vn = _rand(g, n, H, hd), _rand(g, n, hk, hd), _rand(g, n, hk, hd)
    qd, k1, v1 = _rand(g, H, hd), _rand(g, 1, hk, hd), _rand(g, 1, hk, hd)
    outs = []
    for opts in ({}, {"window_size": (INT_MAX, 0), "softcap": 0.0,
                      "sinks": cp.full(H, -np.inf, cp.float32)}):
        cache = KVCache(hk, hd, ms, kv=kv, sink=sink, win=win)
        try:
            p = cache.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0, **opts)
        except ContractError as exc:
            pytest.skip(f"no {kv} kernel with the options: {exc}")
        d = cache.decode(cp.asarray(qd), cp.asarray(k1), cp.asarray(v1), pos=n, kps=32,
                         splits_cap=4, **opts)
        outs.append((p.get(), d.get()))
    for a, b, what in ((outs[0][0], outs[1][0], "prefill"), (outs[0][1], outs[1][1], "decode")):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
            f"{kv} {what}: neutral options changed bits, seed={seed}"


def _stream_shape(kv: str) -> tuple[int, int, dict[str, str]] | None:
    """(head_dim, groups, variants) of the first warp_stream decode pair of ``kv``."""
    from kgen.ir.geometry import streams
    from kgen.runtime.select import decode_variants

    for hd in (64, 128, 256):
        for groups in (4, 2):
            if FORMATS[kv].accepts_head_dim(hd):
                v = decode_variants(kv, hd, groups, streams)
                if v:
                    return hd, groups, v
    return None


@pytest.mark.parametrize("kv", [kv for kv in FORMATS if _stream_shape(kv)])
def test_warp_stream_decode_through_the_cache(cp, kv):
    """A warp_stream decode named as the cache's variants: device-position steps, with
    and without a tile-granular window, from one split to many, match the reference."""
    from kgen.runtime.kv import KVCache

    g, seed = rng()
    hd, G, variants = _stream_shape(kv)
    kd = next(k for k, _ in generated() if k.name == variants["decode"])
    hk, ms, n = 2, 700, 600
    H = hk * G
    sink, win = _shadows(kv, 4, 200)
    cache = KVCache(hk, hd, ms, kv=kv, sink=sink, win=win, variants=variants)
    host = _host(cache)
    kn, vn = _rand(g, n, hk, hd), _rand(g, n, hk, hd)
    cache.append(cp.asarray(kn), cp.asarray(vn), 0)
    ref.append(kn, vn, host, 0, sink, win)
    scale = 1 / math.sqrt(hd)
    for pos, (a_sink, a_win), (kps, cap) in ((n, (0, 0), (64, 16)), (n + 1, (4, 96), (128, 8)),
                                            (n + 2, (0, 0), (1024, 1))):
        qd, k1, v1 = _rand(g, H, hd), _rand(g, 1, hk, hd), _rand(g, 1, hk, hd)
        got = cache.decode(cp.asarray(qd), cp.asarray(k1), cp.asarray(v1), pos=pos, kps=kps,
                           splits_cap=cap, attn_sink=a_sink, attn_win=a_win).get()
        ref.append(k1, v1, host, pos, sink, win)
        kr, vr = ref.read_kv_rows(host, pos, sink, win)
        want = ref.decode_attention(qd, kr, vr, G, pos + 1, kps, cap, a_sink, a_win, scale,
                                    tile=kd.tile_keys)
        assert not np.isnan(got).any(), f"{kv} stream decode left NaN at {pos}, seed={seed}"
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{kv} stream decode at {pos}, seed={seed}")
        assert cache.kernels.get("decode_dev", G)[0].name == variants["decode_dev"]
