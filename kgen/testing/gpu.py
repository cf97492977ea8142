"""GPU checks: launch a kernel on fresh random inputs with NaN-poisoned outputs
and compare every element with the float64 NumPy reference (kgen.numpy_ref,
computed over exactly the values the kernel reads)."""

from __future__ import annotations

import math

import numpy as np

from kgen import numpy_ref as ref
from kgen.spec.axes import KStage, KvFormat, Mode, Op, Position, QStage
from kgen.spec.ir import Kernel
from kgen.testing.case import Case, rng

RTOL, ATOL = 2e-4, 2e-5  # float32 accumulation in tile order vs float64


def _rand(g: np.random.Generator, *shape) -> np.ndarray:
    return g.standard_normal(shape).astype(np.float32)


def _cp():
    import cupy

    return cupy


def _dev(x: np.ndarray):
    return _cp().asarray(x)


def _poisoned(shape, dtype=np.float32):
    a = _cp().empty(shape, dtype)
    a.fill(np.nan if np.dtype(dtype).kind == "f" else 0xAB)
    return a


def _q4_cache(g, n_head_kv: int, hd: int, max_seq: int, pos0: int, upto: int,
              sink: int, win: int) -> ref.Q4Cache:
    """A q4 cache holding positions [0, upto) as the append kernels leave it:
    the history [0, pos0) first, then the batch [pos0, upto)."""
    cache = ref.Q4Cache.empty(n_head_kv, max_seq, hd)
    _fill_q4(g, cache, pos0, upto, sink, win)
    return cache


def _fill_q4(g, cache: ref.Q4Cache, pos0: int, upto: int, sink: int, win: int) -> None:
    hk, hd = cache.n_head_kv, cache.head_dim
    kx, vx = _rand(g, upto, hk, hd), _rand(g, upto, hk, hd)
    for lo in range(0, pos0, ref.WMAX):  # history in race-free batches
        hi = min(lo + ref.WMAX, pos0)
        ref.kv_append_q4(kx[lo:hi], vx[lo:hi], cache, lo, sink, win)
    ref.kv_append_q4(kx[pos0:upto], vx[pos0:upto], cache, pos0, sink, win)


def _upload_q4(cache: ref.Q4Cache):
    return [_dev(x) for x in (cache.k, cache.v, cache.k_sink, cache.v_sink, cache.k_win,
                              cache.v_win)]


def _assert_close(name, got, want, seed, rtol=RTOL, atol=ATOL):
    got = np.asarray(got, dtype=np.float64)
    assert not np.isnan(got).any(), f"{name}: NaN left in output (unwritten element) seed={seed}"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                               err_msg=f"{name} differs from the NumPy reference, seed={seed}")


# ---- per-op checks -------------------------------------------------------------

def check_kernel(k: Kernel, fn, case: Case) -> None:
    """Launch ``fn`` (the generated launcher of ``k``) on ``case`` and compare."""
    {Op.QZ_SPLIT: _check_qz, Op.KV_APPEND: _check_append, Op.FLASH: _check_flash,
     Op.DECODE_COMBINE: _check_combine}[k.op](k, fn, case)


def _check_qz(k, fn, case):
    g, seed = rng()
    qg = _rand(g, case.n, case.n_head, 2 * case.head_dim)
    q, z = _poisoned((case.n, case.n_head, case.head_dim)), _poisoned(
        (case.n, case.n_head, case.head_dim))
    fn(_dev(qg), q, z)
    want_q, want_z = ref.qz_split(qg, case.head_dim)
    assert np.array_equal(q.get(), want_q) and np.array_equal(z.get(), want_z), f"seed={seed}"


def _check_append(k, fn, case):
    g, seed = rng()
    slots = k.position is Position.SLOTS
    n = case.n
    hd, hk, ms = case.head_dim, case.n_head_kv, case.max_seq
    kn, vn = _rand(g, n, hk, hd), _rand(g, n, hk, hd)
    pos = np.array(case.positions or (case.pos0,), dtype=np.int32)
    if k.kv is KvFormat.F32:
        shape = (n, hk, ms, hd) if slots else (hk, ms, hd)
        k_ref, v_ref = _rand(g, *shape), _rand(g, *shape)  # old contents must survive
        kc, vc = _dev(k_ref), _dev(v_ref)
        if k.position is Position.HOST:
            fn(_dev(kn), _dev(vn), kc, vc, pos0=case.pos0)
            ref.kv_append(kn, vn, k_ref, v_ref, case.pos0)
        elif k.position is Position.DEVICE:
            fn(_dev(kn), _dev(vn), kc, vc, _dev(pos))
            ref.kv_append_dev(kn, vn, k_ref, v_ref, pos)
        else:
            fn(_dev(kn), _dev(vn), kc, vc, _dev(pos))
            ref.kv_append_slots(kn, vn, k_ref, v_ref, pos)
        assert np.array_equal(kc.get(), k_ref), f"k_cache differs, seed={seed}"
        assert np.array_equal(vc.get(), v_ref), f"v_cache differs, seed={seed}"
        return
    cache = ref.Q4Cache.empty(hk, ms, hd, nslots=n if slots else None)
    # Old contents (random bytes / halves) must survive outside the written rows.
    for name in ("k", "v", "k_sink", "v_sink", "k_win", "v_win"):
        a = getattr(cache, name)
        a[...] = g.integers(0, 256, a.shape, dtype=np.uint8) if a.dtype == np.uint8 else \
            _rand(g, *a.shape).astype(np.float16)
    dev = _upload_q4(cache)
    q4 = {"sink": case.sink, "win": case.win}
    if k.position is Position.HOST:
        fn(_dev(kn), _dev(vn), *dev, pos0=case.pos0, **q4)
        ref.kv_append_q4(kn, vn, cache, case.pos0, case.sink, case.win)
    elif k.position is Position.DEVICE:
        fn(_dev(kn), _dev(vn), *dev, _dev(pos), **q4)
        ref.kv_append_q4_dev(kn, vn, cache, pos, case.sink, case.win)
    else:
        fn(_dev(kn), _dev(vn), *dev, _dev(pos), **q4)
        ref.kv_append_slots_q4(kn, vn, cache, pos, case.sink, case.win)
    for name, got in zip(("k", "v", "k_sink", "v_sink", "k_win", "v_win"), dev, strict=True):
        want = getattr(cache, name)
        assert np.array_equal(got.get().view(np.uint8), want.view(np.uint8)), \
            f"{name} bytes differ from the reference quantizer, seed={seed}"


def _narrow(k: Kernel):
    """What an fp16 staging does to the values the kernel reads (K, q)."""
    def k_round(x):
        return x.astype(np.float16).astype(np.float32) if k.k_stage is KStage.SHARED_F16 else x

    def q_round(x):
        return x.astype(np.float16).astype(np.float32) if k.q_stage is QStage.F16 else x
    return k_round, q_round


def _prefill_inputs(k: Kernel, case: Case, g):
    hd, hk, ms = case.head_dim, case.n_head_kv, case.max_seq
    q = _rand(g, case.n, case.n_head, hd)
    upto = case.pos0 + case.n
    if k.kv is KvFormat.F32:
        kc, vc = _rand(g, hk, ms, hd), _rand(g, hk, ms, hd)
        return q, (kc, vc), None
    cache = _q4_cache(g, hk, hd, ms, case.pos0, upto, case.sink, case.win)
    return q, None, cache


def prefill_reference(k: Kernel, case: Case, q, f32, cache) -> np.ndarray:
    G = case.n_head // case.n_head_kv
    scale = 1.0 / math.sqrt(case.head_dim)
    k_round, q_round = _narrow(k)
    q = q_round(q)
    if f32 is not None:
        kc, vc = f32
        return ref.prefill_attention(q, k_round(kc), vc, G, case.pos0, case.attn_sink,
                                     case.attn_win, scale)
    if k.k_stage is not KStage.SHARED_F16:
        return ref.prefill_attention_q4(q, cache, G, case.pos0, case.sink, case.win,
                                        case.attn_sink, case.attn_win, scale)
    floor = ref.prefill_live_floor(case.pos0, case.n)

    def rows(_t, cur_pos):
        kk, vv = ref.read_kv_rows_q4(cache, cur_pos, case.sink, case.win, cur_pos + 1, floor)
        return k_round(kk), vv
    return ref.prefill_attention_rows(q, rows, G, case.pos0, case.attn_sink, case.attn_win,
                                      scale)


def run_prefill(k: Kernel, fn, case: Case, q, f32, cache):
    out = _poisoned(q.shape)
    args = dict(pos0=case.pos0, attn_sink=case.attn_sink, attn_win=case.attn_win)
    if f32 is not None:
        fn(_dev(q), _dev(f32[0]), _dev(f32[1]), out, **args)
    else:
        fn(_dev(q), *_upload_q4(cache), out, sink=case.sink, win=case.win, **args)
    return out.get()


def _flash_inputs(k: Kernel, case: Case, g):
    if k.mode is Mode.PREFILL:
        return _prefill_inputs(k, case, g)
    return _decode_inputs(k, case, g)


def _decode_inputs(k: Kernel, case: Case, g):
    hd, hk, ms = case.head_dim, case.n_head_kv, case.max_seq
    if k.position is Position.SLOTS:
        ns = len(case.positions)
        q = _rand(g, ns, case.n_head, hd)
        if k.kv is KvFormat.F32:
            return q, (_rand(g, ns, hk, ms, hd), _rand(g, ns, hk, ms, hd)), None
        cache = ref.Q4Cache.empty(hk, ms, hd, nslots=ns)
        for u, p in enumerate(case.positions):
            _fill_q4(g, cache.slot(u), p, p + 1, case.sink, case.win)
        return q, None, cache
    q = _rand(g, case.n_head, hd)
    if k.kv is KvFormat.F32:
        return q, (_rand(g, hk, ms, hd), _rand(g, hk, ms, hd)), None
    cache = _q4_cache(g, hk, hd, ms, case.seq_len - 1, case.seq_len, case.sink, case.win)
    return q, None, cache


def decode_reference(k: Kernel, case: Case, q, f32, cache):
    """(m, l, acc, out, width): partials in the kernel's layout and the combined output."""
    G = case.n_head // case.n_head_kv
    scale = 1.0 / math.sqrt(case.head_dim)
    if k.position is Position.SLOTS:
        pos = np.array(case.positions, dtype=np.int32)
        if f32 is not None:
            rows = f32[0]
            vrows = f32[1]
        else:
            def rows(u):
                p = int(pos[u])
                return ref.read_kv_rows_q4(cache.slot(u), p, case.sink, case.win, p + 1)
            vrows = None
        m, l, acc, width = ref.decode_partials_slots(q, rows, vrows, pos, G, case.kps, case.cap,
                                                     case.attn_sink, case.attn_win, scale,
                                                     launch_splits=case.extra.get("launch"))
        out = ref.combine(m, l, acc, width)
        return m, l, acc, out, width
    plan = ref.decode_plan(case.seq_len, case.kps, case.cap)
    n_splits, split_len = plan
    if f32 is not None:
        kr, vr = f32
    else:
        kr, vr = ref.read_kv_rows_q4(cache, case.seq_len - 1, case.sink, case.win, case.seq_len)
    m, l, acc = ref.decode_partials(q, kr, vr, G, case.seq_len, n_splits, split_len,
                                    case.attn_sink, case.attn_win, scale)
    return m, l, acc, ref.combine(m, l, acc, n_splits), n_splits


def run_decode(k: Kernel, fn, case: Case, q, f32, cache, width: int):
    """Launch the split kernel; returns (m, l, acc) trimmed to the live layout."""
    cp = _cp()
    slots = k.position is Position.SLOTS
    heads = q.shape[0] * q.shape[1] if slots else q.shape[0]
    buf_w = case.cap if k.position is Position.DEVICE else width
    m, l = _poisoned(heads * buf_w), _poisoned(heads * buf_w)
    acc = _poisoned(heads * buf_w * case.head_dim)
    caches = [_dev(x) for x in f32] if f32 is not None else _upload_q4(cache)
    q4 = {} if f32 is not None else {"sink": case.sink, "win": case.win}
    win = dict(attn_sink=case.attn_sink, attn_win=case.attn_win)
    if k.position is Position.HOST:
        plan = ref.decode_plan(case.seq_len, case.kps, case.cap)
        fn(_dev(q), *caches, m, l, acc, seq_len=case.seq_len, n_splits=plan[0],
           split_len=plan[1], **q4, **win)
    elif k.position is Position.DEVICE:
        pos = cp.asarray([case.seq_len - 1], dtype=cp.int32)
        fn(_dev(q), *caches, m, l, acc, pos, kps=case.kps, splits_cap=case.cap, **q4, **win)
    else:
        pos = cp.asarray(case.positions, dtype=cp.int32)
        fn(_dev(q), *caches, m, l, acc, pos, kps=case.kps, splits_cap=case.cap,
           launch_splits=width, **q4, **win)
    n = heads * width
    return m.get()[:n], l.get()[:n], acc.get()[: n * case.head_dim]


def _check_flash(k, fn, case):
    g, seed = rng()
    q, f32, cache = _flash_inputs(k, case, g)
    if k.mode is Mode.PREFILL:
        _assert_close(k.name, run_prefill(k, fn, case, q, f32, cache),
                      prefill_reference(k, case, q, f32, cache), seed)
        return
    m_ref, l_ref, acc_ref, out_ref, width = decode_reference(k, case, q, f32, cache)
    m, l, acc = run_decode(k, fn, case, q, f32, cache, width)
    _assert_close(f"{k.name} m", m, m_ref.reshape(-1), seed)
    _assert_close(f"{k.name} l", l, l_ref.reshape(-1), seed, rtol=RTOL * 4)
    _assert_close(f"{k.name} acc", acc, acc_ref.reshape(-1), seed, rtol=RTOL * 4,
                  atol=ATOL * 8)
    out = ref.combine(m.reshape(m_ref.shape), l.reshape(l_ref.shape),
                      acc.reshape(acc_ref.shape), width)
    _assert_close(f"{k.name} combined", out, out_ref, seed)


def _check_combine(k, fn, case):
    g, seed = rng()
    heads, S, hd = case.n_head, case.n_splits, case.head_dim
    if k.position is Position.DEVICE:
        S = ref.decode_plan(case.seq_len, case.kps, case.cap)[0]
    m = _rand(g, heads, S) * 3
    l = np.abs(_rand(g, heads, S)) + 0.5
    acc = _rand(g, heads, S, hd)
    if S > 1:  # an empty split (window-skipped or off-plan) must weigh exactly 0
        m[0, S - 1], l[0, S - 1], acc[0, S - 1] = -np.inf, 0.0, 0.0
    out = _poisoned((heads, hd))
    if k.position is Position.HOST:
        fn(_dev(m), _dev(l), _dev(acc), out, n_splits=S)
    else:
        pos = _cp().asarray([case.seq_len - 1], dtype=np.int32)
        fn(_dev(m), _dev(l), _dev(acc), out, pos, kps=case.kps, splits_cap=case.cap)
    _assert_close(k.name, out.get(), ref.combine(m, l, acc, S), seed)


# ---- relations between kernels ------------------------------------------------------

def check_relation(kind: str, tolerance: float, ka: Kernel, fa, kb: Kernel, fb,
                   case: Case) -> None:
    """Both kernels on the same inputs: bit-identical, or within ``tolerance``
    relative to the largest output magnitude."""
    g, seed = rng()
    q, f32, cache = _flash_inputs(ka, case, g)
    if ka.mode is Mode.PREFILL:
        a = run_prefill(ka, fa, case, q, f32, cache)
        b = run_prefill(kb, fb, case, q, f32, cache)
    else:
        width = decode_reference(kb, case, q, f32, cache)[4]
        a = np.concatenate(run_decode(ka, fa, case, q, f32, cache, width))
        b = np.concatenate(run_decode(kb, fb, case, q, f32, cache, width))
    assert not np.isnan(a).any() and not np.isnan(b).any(), f"NaN in outputs, seed={seed}"
    if kind == "bit_exact":
        diff = int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))
        assert diff == 0, f"{ka.name} vs {kb.name}: {diff} of {a.size} floats differ, seed={seed}"
    else:
        err = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
        assert err <= tolerance, f"{ka.name} vs {kb.name}: relative error {err:.3g} > " \
                                 f"{tolerance:g}, seed={seed}"


