"""Harness for the generated kernel tests (tests/generated/, from templates/tests/).

For a kernel and a Case it draws fresh random inputs, computes the NumPy
reference (kgen.numpy_ref, float64 over exactly the values the kernel reads),
poisons every output with NaN, launches through the generated launcher and
compares every element. Contract checks run on the host (kgen.runtime.bind
with NumPy arrays), so they need no GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from kgen import numpy_ref as ref
from kgen.geometry import q4_row_bytes
from kgen.runtime.bind import bind
from kgen.runtime.contracts import ContractError
from kgen.spec.axes import KStage, KvFormat, Mode, Op, Position, QStage
from kgen.spec.ir import Kernel

RTOL, ATOL = 2e-4, 2e-5  # float32 accumulation in tile order vs float64


@dataclass(frozen=True)
class Case:
    """One launch shape. Unused fields are ignored by ops that do not read them."""

    name: str
    n: int = 1                 # query/append rows (prefill, append) or slots
    n_head: int = 8
    n_head_kv: int = 2
    head_dim: int = 256
    max_seq: int = 64
    pos0: int = 0              # first position of the batch (prefill/append)
    seq_len: int = 1           # decode context length (host and device position)
    positions: tuple[int, ...] = ()  # per-slot positions (slots kernels)
    sink: int = 0              # fp16 sink rows written/read (q4)
    win: int = 0               # fp16 window rows (q4)
    attn_sink: int = 0
    attn_win: int = 0
    kps: int = 64
    cap: int = 8
    n_splits: int = 3          # combine only
    extra: dict = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        return self.name

    def with_(self, **kw) -> Case:
        return replace(self, **kw)


# ---- inputs -------------------------------------------------------------------

def rng() -> tuple[np.random.Generator, int]:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


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


# ---- contracts (host only) -------------------------------------------------------------

def host_args(k: Kernel, case: Case, alloc=np.zeros) -> dict:
    """A valid argument set of NumPy arrays for ``bind`` (contents irrelevant);
    ``alloc(shape, dtype)`` makes each array."""
    z = alloc
    hd, hk, ms = case.head_dim, case.n_head_kv, case.max_seq
    f32 = np.float32
    if k.op is Op.QZ_SPLIT:
        return dict(qg=z((case.n, case.n_head, 2 * hd), f32), q=z((case.n, case.n_head, hd), f32),
                    z=z((case.n, case.n_head, hd), f32))
    slots = k.position is Position.SLOTS
    ns = len(case.positions) if slots else 0
    lead = (ns, hk) if slots else (hk,)
    a: dict = {}
    if k.op in (Op.KV_APPEND, Op.FLASH):
        row = q4_row_bytes(hd) if k.kv is KvFormat.Q4 else hd
        dt = np.uint8 if k.kv is KvFormat.Q4 else f32
        a.update(k_cache=z((*lead, ms, row), dt), v_cache=z((*lead, ms, row), dt))
        if k.kv is KvFormat.Q4:
            a.update(k_sink=z((*lead, k.sink_rows, hd), np.float16),
                     v_sink=z((*lead, k.sink_rows, hd), np.float16),
                     k_win=z((*lead, k.ring_rows, hd), np.float16),
                     v_win=z((*lead, k.ring_rows, hd), np.float16), sink=case.sink, win=case.win)
    pos = np.array(case.positions or (case.seq_len - 1,), dtype=np.int32)
    if k.op is Op.KV_APPEND:
        rows = ns if slots else (1 if k.position is Position.DEVICE else case.n)
        a.update(k_new=z((rows, hk, hd), f32), v_new=z((rows, hk, hd), f32))
        if k.position is Position.HOST:
            a["pos0"] = case.pos0
        else:
            a["pos"] = np.array(case.positions or (case.pos0,), dtype=np.int32)
        return a
    if k.op is Op.FLASH:
        a.update(attn_sink=0, attn_win=0, scale=None)
        if k.mode is Mode.PREFILL:
            a.update(q=z((case.n, case.n_head, hd), f32), out=z((case.n, case.n_head, hd), f32),
                     pos0=case.pos0)
            return a
        heads = case.n_head * (ns or 1)
        a["q"] = z((ns, case.n_head, hd), f32) if slots else z((case.n_head, hd), f32)
        a.update(m_out=z(heads * case.cap, f32), l_out=z(heads * case.cap, f32),
                 acc_out=z(heads * case.cap * hd, f32))
        if k.position is Position.HOST:
            plan = ref.decode_plan(case.seq_len, case.kps, case.cap)
            a.update(seq_len=case.seq_len, n_splits=plan[0], split_len=plan[1])
        else:
            a.update(pos=pos, kps=case.kps, splits_cap=case.cap)
        return a
    S = case.cap
    a.update(m_in=z(case.n_head * S, f32), l_in=z(case.n_head * S, f32),
             acc_in=z(case.n_head * S * hd, f32), out=z((case.n_head, hd), f32))
    if k.position is Position.HOST:
        a["n_splits"] = S
    else:
        a.update(pos=pos, kps=case.kps, splits_cap=case.cap)
    return a


# ---- contract mutations: each breaks one contract of a valid launch ---------------------

@dataclass(frozen=True)
class Mutation:
    contract: str
    applies: object  # Kernel -> bool, from the kernel's axes
    make: object     # (Kernel, Case) -> args dict breaking the contract


def _flash(k):
    return k.op is Op.FLASH


def _q4(k):
    return k.kv is KvFormat.Q4 and k.op in (Op.FLASH, Op.KV_APPEND)


def _args_with(**case_kw):
    return lambda k, case: host_args(k, case.with_(**case_kw))


def _set(name, value_fn):
    def make(k, case):
        a = host_args(k, case)
        a[name] = value_fn(a[name], k, case)
        return a
    return make


def _strided(a, k, case):
    wide = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), a.dtype)
    return wide[..., ::2]


def _first_array(k):
    return {Op.QZ_SPLIT: "q", Op.KV_APPEND: "k_new", Op.FLASH: "q",
            Op.DECODE_COMBINE: "out"}[k.op]


def _non_contiguous(k, case):
    a = host_args(k, case)
    name = _first_array(k)
    a[name] = _strided(a[name], k, case)
    return a


def _wrong_dtype(k, case):
    a = host_args(k, case)
    name = _first_array(k)
    a[name] = a[name].astype(np.float64)
    return a


def _decode_host(k):
    return _flash(k) and k.mode is Mode.DECODE and k.position is Position.HOST


def _pos_dev(k):
    return k.position is not Position.HOST and k.op in (Op.FLASH, Op.KV_APPEND)


class ShapeOnly:
    """An array stand-in with a shape and dtype but no storage, for launches too
    large to allocate (bind reads only shape, dtype, ndim, size and flags)."""

    class _Flags:
        c_contiguous = True

    def __init__(self, shape, dtype):
        self.shape = tuple(shape) if np.iterable(shape) else (int(shape),)
        self.dtype = np.dtype(dtype)
        self.ndim, self.size, self.flags = len(self.shape), int(np.prod(self.shape)), self._Flags()


def _shape_only(**case_kw):
    """Every array of the case replaced by a ShapeOnly of the same shape."""
    return lambda k, case: host_args(k, case.with_(**case_kw), alloc=ShapeOnly)


def _int_scalar(k) -> str | None:
    """A user-visible integer argument of the kernel, if it has one."""
    if k.op in (Op.KV_APPEND, Op.FLASH) and k.position is Position.HOST:
        return "pos0" if (k.op is Op.KV_APPEND or k.mode is Mode.PREFILL) else "seq_len"
    if k.position is not Position.HOST:
        return "kps" if k.op is not Op.KV_APPEND else None
    return "n_splits" if k.op is Op.DECODE_COMBINE else None


def _not_an_integer(k, case):
    a = host_args(k, case)
    name = _int_scalar(k)
    a[name] = a[name] + 0.5
    return a


def _big_head_dim(k, case):
    hd = 2048
    return _shape_only(head_dim=hd)(k, case)


MUTATIONS: dict[str, Mutation] = {
    "not_an_array": Mutation("array", lambda k: True, lambda k, c: {
        **host_args(k, c), _first_array(k): [0.0, 1.0]}),
    "not_an_integer": Mutation("type", lambda k: _int_scalar(k) is not None, _not_an_integer),
    "scale_not_finite": Mutation("scale", _flash, lambda k, c: {
        **host_args(k, c), "scale": float("inf")}),
    "head_dim_over_block": Mutation("block size", lambda k: k.op is not Op.QZ_SPLIT,
                                    _big_head_dim),
    "qz_int32_index": Mutation("int32 index", lambda k: k.op is Op.QZ_SPLIT,
                               _shape_only(n=2**16, n_head=2**8, head_dim=2**8)),
    "grid_y_over_limit": Mutation("grid", lambda k: k.op is Op.KV_APPEND and
                                  k.position is not Position.SLOTS,
                                  _shape_only(n_head_kv=70000)),
    "max_seq_over_int": Mutation("max_seq", lambda k: k.op is Op.KV_APPEND and
                                 k.position is Position.HOST, _shape_only(max_seq=2**31)),
    "int32_position": Mutation("int32 position", lambda k: k.op is Op.KV_APPEND and
                               k.position is Position.HOST, lambda k, c: {
                                   **host_args(k, c), "pos0": 2**31 - 2}),
    "wrong_dtype": Mutation("dtype", lambda k: True, _wrong_dtype),
    "non_contiguous": Mutation("contiguous", lambda k: True, _non_contiguous),
    "qz_shape_mismatch": Mutation("shape", lambda k: k.op is Op.QZ_SPLIT, _set(
        "z", lambda a, k, c: np.zeros((*a.shape[:-1], a.shape[-1] - 1), a.dtype))),
    "head_dim_below_tile": Mutation("every key scored", _flash, _args_with(head_dim=128)),
    "head_dim_partial_warp": Mutation(
        "whole warps", lambda k: _flash(k) and k.kv is KvFormat.F32, _args_with(head_dim=272)),
    "q4_head_dim": Mutation("q4 head_dim", lambda k: k.op is Op.KV_APPEND and _q4(k),
                            _args_with(head_dim=48)),
    "kv_groups_over_max": Mutation("kv_groups", _flash, lambda k, c: host_args(
        k, c.with_(n_head=2 * (k.max_groups + 1), n_head_kv=2))),
    "gqa_mismatch": Mutation("GQA", _flash, _args_with(n_head=7, n_head_kv=2)),
    "shared_memory": Mutation("shared memory", lambda k: _flash(k) and k.k_stage is not
                              KStage.REGISTERS,
                              _args_with(head_dim=1024, n_head=16, n_head_kv=2)),
    "register_k_chunk": Mutation("register K chunk", lambda k: _flash(k) and k.k_stage is
                                 KStage.REGISTERS, _args_with(head_dim=512, n_head=2,
                                                              n_head_kv=2)),
    "prefill_ring_wrap": Mutation("no ring wrap", lambda k: _flash(k) and k.mode is
                                  Mode.PREFILL, lambda k, c: host_args(
                                      k, c.with_(pos0=c.max_seq - c.n + 1))),
    "negative_pos0": Mutation("range", lambda k: k.position is Position.HOST and
                              (k.op is Op.KV_APPEND or (_flash(k) and k.mode is Mode.PREFILL)),
                              _args_with(pos0=-1)),
    "sink_rows": Mutation("sink rows", _q4, lambda k, c: host_args(
        k, c.with_(sink=k.sink_rows + 1))),
    "window_ring": Mutation("window ring", _q4, lambda k, c: host_args(
        k, c.with_(win=k.ring_rows + 1))),
    "append_ring_race": Mutation(
        "ring write race", lambda k: k.op is Op.KV_APPEND and k.position is Position.HOST,
        lambda k, c: host_args(k, c.with_(
            n=(k.ring_rows if k.kv is KvFormat.Q4 else c.max_seq) + 1, pos0=0, win=8,
            max_seq=(4 * k.ring_rows if k.kv is KvFormat.Q4 else c.max_seq)))),
    "device_append_rows": Mutation(
        "one decode row", lambda k: k.op is Op.KV_APPEND and k.position is Position.DEVICE,
        lambda k, c: {**host_args(k, c), "k_new": np.zeros((2, c.n_head_kv, c.head_dim),
                                                           np.float32),
                      "v_new": np.zeros((2, c.n_head_kv, c.head_dim), np.float32)}),
    "decode_past_max_seq": Mutation("no ring wrap", _decode_host, lambda k, c: {
        **host_args(k, c), "seq_len": c.max_seq + 1}),
    "decode_bad_plan": Mutation("split plan", _decode_host, lambda k, c: {
        **host_args(k, c), "n_splits": host_args(k, c)["n_splits"] + 1}),
    "split_len_not_tiles": Mutation("split plan", _decode_host, lambda k, c: {
        **host_args(k, c), "split_len": k.tile_keys + 1}),
    "negative_device_pos": Mutation("position", _pos_dev, _set(
        "pos", lambda a, k, c: np.full_like(a, -1))),
    "device_pos_past_max_seq": Mutation(
        "no ring wrap", lambda k: _pos_dev(k) and (_flash(k) or k.kv is KvFormat.Q4),
        _set("pos", lambda a, k, c: np.full_like(a, c.max_seq))),
    "slots_launch_too_narrow": Mutation(
        "slot plan coverage", lambda k: _flash(k) and k.position is Position.SLOTS,
        lambda k, c: {**host_args(k, c), "launch_splits": 1}),
    "partials_too_small": Mutation(
        "partials size", lambda k: (_flash(k) and k.mode is Mode.DECODE) or
        k.op is Op.DECODE_COMBINE,
        lambda k, c: {**host_args(k, c), **({"acc_out": np.zeros(8, np.float32)} if _flash(k)
                                            else {"acc_in": np.zeros(8, np.float32)})}),
}


def mutations_for(k: Kernel) -> list[str]:
    return [name for name, m in MUTATIONS.items() if m.applies(k)]


def check_mutation(k: Kernel, case: Case, mutation: str) -> None:
    """The case binds; the mutated arguments raise the mutation's contract."""
    m = MUTATIONS[mutation]
    bind(k, host_args(k, case))
    try:
        bind(k, m.make(k, case))
    except ContractError as exc:
        assert exc.contract == m.contract, f"{mutation}: expected contract {m.contract!r}, " \
                                           f"got {exc}"
        return
    raise AssertionError(f"{k.name}: {mutation} (breaks {m.contract!r}) was accepted")
