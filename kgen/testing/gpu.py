"""GPU checks: launch a kernel on fresh random inputs with NaN-poisoned outputs
and compare every element with the float64 NumPy reference (kgen.numpy_ref,
computed over exactly the values the kernel reads).

The checks of qz_split and of the cache ops over a host, device or slots position, and
the relation of two kernels over one cache; each op names its own (kgen.ops:
``gpu_check``, ``gpu_relation``; kgen.testing.checks asks it), so nothing here asks an
op object."""

from __future__ import annotations

import math

import numpy as np

from kgen import numpy_ref as ref
from kgen.ir.axes import KStage, Mode, Position, QStage, RingFloor, Sinks
from kgen.ir.geometry import key_partials
from kgen.ir.kernel import Kernel
from kgen.testing.case import Case, random_bits, rng
from kgen.testing.device import ATOL, RTOL, assert_close, cupy, dev, poisoned
from kgen.testing.keywords import (
    combined,
    options,
    prefill_outputs,
    ref_options,
    shadow_args,
    sink_logits,
    split_outputs,
)


def _rand(g: np.random.Generator, *shape) -> np.ndarray:
    return g.standard_normal(shape).astype(np.float32)


def _cache(k: Kernel, case: Case, nslots: int | None = None) -> ref.HostCache:
    return ref.HostCache.empty(k.pair, case.n_head_kv, case.max_seq, case.head_dim,
                               ring_rows=k.ring_rows, sink_rows=k.sink_rows, nslots=nslots,
                               k_scale=case.k_scale, v_scale=case.v_scale)


def _filled(g, k: Kernel, case: Case, pos0: int, upto: int) -> ref.HostCache:
    """A cache holding positions [0, upto) as the append kernels leave it (the
    history [0, pos0), then the batch); rows never appended decode to NaN."""
    cache = _cache(k, case)
    hk, hd = case.n_head_kv, case.head_dim
    ref.fill(cache, _rand(g, upto, hk, hd), _rand(g, upto, hk, hd), pos0, upto, case.sink,
             case.win)
    return cache


def _upload(cache: ref.HostCache):
    return [dev(x) for x in cache.arrays]


# ---- each op's check (its op object names it: kgen.ops, gpu_check) ---------------------

def check_qz(k, fn, case):
    """qz_split: q and z bit for bit."""
    g, seed = rng()
    qg = _rand(g, case.n, case.n_head, 2 * case.head_dim)
    q, z = poisoned((case.n, case.n_head, case.head_dim)), poisoned(
        (case.n, case.n_head, case.head_dim))
    fn(dev(qg), q, z)
    want_q, want_z = ref.qz_split(qg, case.head_dim)
    assert np.array_equal(q.get(), want_q) and np.array_equal(z.get(), want_z), f"seed={seed}"


def check_append(k, fn, case):
    """kv_append (host, device, slots): the cache's bytes as the format's model leaves them."""
    g, seed = rng()
    slots = k.position is Position.SLOTS
    n, hk, hd = case.n, case.n_head_kv, case.head_dim
    kn, vn = _rand(g, n, hk, hd), _rand(g, n, hk, hd)
    pos = np.array(case.positions or (case.pos0,), dtype=np.int32)
    cache = _cache(k, case, nslots=n if slots else None)
    # Old contents (random values; random bits for a format stored as integers) must
    # survive outside the written rows.
    for a in cache.arrays:
        a[...] = random_bits(g, a) if a.dtype.kind in "ui" else \
            _rand(g, *a.shape).astype(a.dtype)
    bufs = _upload(cache)
    sw = shadow_args(k, case)
    if k.position is Position.HOST:
        fn(dev(kn), dev(vn), *bufs, pos0=case.pos0, **sw)
        ref.append(kn, vn, cache, case.pos0, case.sink, case.win)
    elif k.position is Position.DEVICE:
        fn(dev(kn), dev(vn), *bufs, dev(pos), **sw)
        ref.append_dev(kn, vn, cache, pos, case.sink, case.win)
    else:
        fn(dev(kn), dev(vn), *bufs, dev(pos), **sw)
        ref.append_slots(kn, vn, cache, pos, case.sink, case.win)
    names = ["k_cache", "v_cache", *cache.shadows]
    for name, got, want in zip(names, bufs, cache.arrays, strict=True):
        assert np.array_equal(got.get().view(np.uint8), want.view(np.uint8)), \
            f"{name} bytes differ from the {k.pair.name} model, seed={seed}"


def _narrow(k: Kernel):
    """What an fp16 staging does to the values the kernel reads (K, q)."""
    def k_round(x):
        return x.astype(np.float16).astype(np.float32) if k.k_stage is KStage.SHARED_F16 else x

    def q_round(x):
        return x.astype(np.float16).astype(np.float32) if k.q_stage is QStage.F16 else x
    return k_round, q_round


def _flash_inputs(k: Kernel, case: Case, g):
    """(q, cache): q as the launch takes it; the cache holds the keys it reads."""
    hd = case.head_dim
    if k.mode is Mode.PREFILL:
        q = _rand(g, case.n, case.n_head, hd)
        return q, _filled(g, k, case, case.pos0, case.pos0 + case.n)
    if k.position is Position.SLOTS:
        ns = len(case.positions)
        cache = _cache(k, case, nslots=ns)
        for u, p in enumerate(case.positions):
            kx, vx = _rand(g, p + 1, case.n_head_kv, hd), _rand(g, p + 1, case.n_head_kv, hd)
            ref.fill(cache.slot(u), kx, vx, p, p + 1, case.sink, case.win)
        return _rand(g, ns, case.n_head, hd), cache
    return _rand(g, case.n_head, hd), _filled(g, k, case, case.seq_len - 1, case.seq_len)


def _tiling(k: Kernel) -> dict:
    return {"tile": k.tile_keys, "max_groups": k.max_groups}


def prefill_reference(k: Kernel, case: Case, q, cache, sinks=None) -> np.ndarray:
    G = case.n_head // case.n_head_kv
    scale = 1.0 / math.sqrt(case.head_dim)
    k_round, q_round = _narrow(k)
    floor = (ref.prefill_live_floor(case.pos0, case.n, k.ring_rows)
             if k.ring_floor is RingFloor.BATCH else None)
    return ref.prefill_attention_cache(q_round(q), cache, G, case.pos0, case.sink, case.win,
                                       case.attn_sink, case.attn_win, scale, floor,
                                       k_round=k_round, **_tiling(k), **ref_options(k, case),
                                       sinks=sinks if k.sinks is Sinks.LEARNED else None)


def run_prefill(k: Kernel, fn, case: Case, q, cache, sinks=None, raw: bool = False):
    """The launch's output (a split prefill's partials folded in float64; ``raw``: its
    partials as written, m, l and acc one after another)."""
    n, n_head, hd = q.shape
    parts = prefill_outputs(k, n, n_head, hd, poisoned)
    outs, extra = split_outputs(parts)
    if k.sinks is Sinks.LEARNED:
        extra["sinks"] = dev(sinks)
    fn(dev(q), *_upload(cache), *outs, pos0=case.pos0, attn_sink=case.attn_sink,
       **options(k, case), **shadow_args(k, case), **extra)
    if raw and key_partials(k):
        return np.concatenate([a.get() for a in outs])
    return combined(k, parts, n, n_head, hd)


def decode_reference(k: Kernel, case: Case, q, cache):
    """(m, l, acc, out, width): partials in the kernel's layout and the combined output."""
    G = case.n_head // case.n_head_kv
    scale = 1.0 / math.sqrt(case.head_dim)
    k_round, q_round = _narrow(k)
    q = q_round(q)

    def rows(c: ref.HostCache, p: int):
        kk, vv = ref.read_kv_rows(c, p, case.sink, case.win, p + 1)
        return k_round(kk), vv

    if k.position is Position.SLOTS:
        pos = np.array(case.positions, dtype=np.int32)
        m, l, acc, width = ref.decode_partials_slots(
            q, lambda u: rows(cache.slot(u), int(pos[u])), None, pos, G, case.kps, case.cap,
            case.attn_sink, case.attn_win, scale, launch_splits=case.extra.get("launch"),
            **_tiling(k), **ref_options(k, case))
        return m, l, acc, ref.combine(m, l, acc, width), width
    n_splits, split_len = ref.decode_plan(case.seq_len, case.kps, case.cap, k.tile_keys)
    kr, vr = rows(cache, case.seq_len - 1)
    m, l, acc = ref.decode_partials(q, kr, vr, G, case.seq_len, n_splits, split_len,
                                    case.attn_sink, case.attn_win, scale, **_tiling(k),
                                    **ref_options(k, case))
    return m, l, acc, ref.combine(m, l, acc, n_splits), n_splits


def run_decode(k: Kernel, fn, case: Case, q, cache, width: int):
    """Launch the split kernel; returns (m, l, acc) trimmed to the live layout."""
    cp = cupy()
    slots = k.position is Position.SLOTS
    heads = q.shape[0] * q.shape[1] if slots else q.shape[0]
    buf_w = case.cap if k.position is Position.DEVICE else width
    m, l = poisoned(heads * buf_w), poisoned(heads * buf_w)
    acc = poisoned(heads * buf_w * case.head_dim)
    common = dict(attn_sink=case.attn_sink, **options(k, case), **shadow_args(k, case))
    if k.position is Position.HOST:
        n_splits, split_len = ref.decode_plan(case.seq_len, case.kps, case.cap, k.tile_keys)
        fn(dev(q), *_upload(cache), m, l, acc, seq_len=case.seq_len, n_splits=n_splits,
           split_len=split_len, **common)
    elif k.position is Position.DEVICE:
        pos = cp.asarray([case.seq_len - 1], dtype=cp.int32)
        fn(dev(q), *_upload(cache), m, l, acc, pos, kps=case.kps, splits_cap=case.cap,
           **common)
    else:
        pos = cp.asarray(case.positions, dtype=cp.int32)
        fn(dev(q), *_upload(cache), m, l, acc, pos, kps=case.kps, splits_cap=case.cap,
           launch_splits=width, **common)
    n = heads * width
    return m.get()[:n], l.get()[:n], acc.get()[: n * case.head_dim]


def check_flash(k, fn, case):
    """flash (host, device, slots): the output, or every live partial and their combination."""
    g, seed = rng()
    q, cache = _flash_inputs(k, case, g)
    if k.mode is Mode.PREFILL:
        sinks = sink_logits(g, case, case.n_head)
        assert_close(k.name, run_prefill(k, fn, case, q, cache, sinks),
                     prefill_reference(k, case, q, cache, sinks), seed)
        return
    m_ref, l_ref, acc_ref, out_ref, width = decode_reference(k, case, q, cache)
    m, l, acc = run_decode(k, fn, case, q, cache, width)
    assert_close(f"{k.name} m", m, m_ref.reshape(-1), seed)
    assert_close(f"{k.name} l", l, l_ref.reshape(-1), seed, rtol=RTOL * 4)
    assert_close(f"{k.name} acc", acc, acc_ref.reshape(-1), seed, rtol=RTOL * 4,
                 atol=ATOL * 8)
    out = ref.combine(m.reshape(m_ref.shape), l.reshape(l_ref.shape),
                      acc.reshape(acc_ref.shape), width)
    assert_close(f"{k.name} combined", out, out_ref, seed)


def check_combine(k, fn, case):
    """decode_combine: random partials (an empty split among them) and their merge."""
    g, seed = rng()
    heads, S, hd = case.n_head, case.n_splits, case.head_dim
    if k.position is Position.DEVICE:
        S = ref.decode_plan(case.seq_len, case.kps, case.cap, k.tile_keys)[0]
    m = _rand(g, heads, S) * 3
    l = np.abs(_rand(g, heads, S)) + 0.5
    acc = _rand(g, heads, S, hd)
    if S > 1:  # an empty split (window-skipped or off-plan) must weigh exactly 0
        m[0, S - 1], l[0, S - 1], acc[0, S - 1] = -np.inf, 0.0, 0.0
    out = poisoned((heads, hd))
    sinks = sink_logits(g, case, heads) if k.sinks is Sinks.LEARNED else None
    extra = {"sinks": dev(sinks)} if sinks is not None else {}
    if k.position is Position.HOST:
        fn(dev(m), dev(l), dev(acc), out, *extra.values(), n_splits=S)
    else:
        pos = cupy().asarray([case.seq_len - 1], dtype=np.int32)
        fn(dev(m), dev(l), dev(acc), out, *extra.values(), pos, kps=case.kps,
           splits_cap=case.cap)
    assert_close(k.name, out.get(), ref.combine(m, l, acc, S, sinks), seed)


# ---- relations between kernels (each op names its own: kgen.ops, gpu_relation) --------

def cache_relation(kind: str, tolerance: float, ka: Kernel, fa, kb: Kernel, fb,
                   case: Case) -> None:
    """Both kernels on the same inputs (one filled KV cache): bit-identical (decode:
    every partial), or within ``tolerance`` relative to the largest output magnitude
    (decode: the combined output, since an empty split's m is -inf in both)."""
    g, seed = rng()
    q, cache = _flash_inputs(ka, case, g)
    if ka.mode is Mode.PREFILL:
        sinks = sink_logits(g, case, case.n_head)
        raw = kind == "bit_exact" and key_partials(ka) and key_partials(kb)
        a = run_prefill(ka, fa, case, q, cache, sinks, raw)
        b = run_prefill(kb, fb, case, q, cache, sinks, raw)
    else:
        width = decode_reference(kb, case, q, cache)[4]
        pa = run_decode(ka, fa, case, q, cache, width)
        pb = run_decode(kb, fb, case, q, cache, width)
        if kind == "bit_exact":
            a, b = np.concatenate(pa), np.concatenate(pb)
        else:
            a, b = ref.combine(*pa, width), ref.combine(*pb, width)
    assert not np.isnan(a).any() and not np.isnan(b).any(), f"NaN in outputs, seed={seed}"
    if kind == "bit_exact":
        diff = int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))
        assert diff == 0, f"{ka.name} vs {kb.name}: {diff} of {a.size} floats differ, seed={seed}"
    else:
        err = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
        assert err <= tolerance, f"{ka.name} vs {kb.name}: relative error {err:.3g} > " \
                                 f"{tolerance:g}, seed={seed}"


def combine_relation(kind, tolerance, ka, fa, kb, fb, case):
    """Two combine kernels on the same partials (each given the sinks it takes)."""
    g, seed = rng()
    heads, S, hd = case.n_head, case.n_splits, case.head_dim
    if ka.position is Position.DEVICE:
        S = ref.decode_plan(case.seq_len, case.kps, case.cap, ka.tile_keys)[0]
    m, l = _rand(g, heads, S) * 3, np.abs(_rand(g, heads, S)) + 0.5
    acc = _rand(g, heads, S, hd)
    sinks = sink_logits(g, case, heads)
    outs = []
    for k, fn in ((ka, fa), (kb, fb)):
        out = poisoned((heads, hd))
        extra = [dev(sinks)] if k.sinks is Sinks.LEARNED else []
        if k.position is Position.HOST:
            fn(dev(m), dev(l), dev(acc), out, *extra, n_splits=S)
        else:
            pos = cupy().asarray([case.seq_len - 1], dtype=np.int32)
            fn(dev(m), dev(l), dev(acc), out, *extra, pos, kps=case.kps,
               splits_cap=case.cap)
        outs.append(out.get())
    a, b = outs
    if kind == "bit_exact":
        diff = int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))
        assert diff == 0, f"{ka.name} vs {kb.name}: {diff} of {a.size} floats differ, seed={seed}"
    else:
        err = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
        assert err <= tolerance, f"{ka.name} vs {kb.name}: relative error {err:.3g}, seed={seed}"
