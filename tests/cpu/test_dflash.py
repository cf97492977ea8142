"""dflash_attention (the engine's DFlash block attention) without a GPU: the float64
references against the definition, one query at a time, and the paged one against the
dense one over the materialized [context ; block]; the generated GPU check run over an
f32 emulation of the kernels' arithmetic (lanes, butterfly, one key folded at a time:
its tolerances hold for that arithmetic, and a kernel that breaks the definition, or
the paged kernel's bit-identity with the dense one, fails it), for every element type
pair (16-bit inputs widened exactly, outputs rounded to nearest even); the 16-bit
kernels' source as the f32 kernels' with conversions at the loads and stores; bind's
geometry, defaults and ranges; the runtime's entry points with CuPy replaced by a
stand-in (kernel choice by the arrays' element types, arguments, the index arrays
checked on the host, refusals before a launch).

Random inputs are fresh each run (KGEN_TEST_SEED=<seed> replays one)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import kgen_kernels
import numpy as np
import pytest

from kgen.compiler import pipeline
from kgen.compiler.render import render_units
from kgen.formats import FORMATS
from kgen.ir.axes import IoDtype, KeySource, Op
from kgen.ir.geometry import DFLASH_ROWS, dflash_chunks, dflash_threads
from kgen.ir.params import INT_MAX, PARAMS
from kgen.numpy_ref import dflash_block_attention as ref_dense
from kgen.numpy_ref import dflash_paged_block_attention as ref_paged
from kgen.numpy_ref.dflash import gather_context, widen
from kgen.ops import params
from kgen.runtime import ContractError, bind, dflash_block_attention, dflash_paged_block_attention
from kgen.runtime import dflash as runtime_dflash
from kgen.testing import dflash as tdflash
from kgen.testing.case import Case
from kgen.testing.fakecupy import FakeArray, FakeCupy
from kgen.testing.testgen import plan_cases

ROOT = Path(__file__).resolve().parents[2]
DENSE, PAGED = KeySource.DENSE, KeySource.PAGED
F32, BF16, F16 = IoDtype.F32, IoDtype.BF16, IoDtype.F16
# every built kernel by (key_source, in_dtype, out_dtype); the f32 ones by key source
ALL = {(k.key_source, k.in_dtype, k.out_dtype): k for mod in kgen_kernels.MODULES.values()
       for k in mod.KERNELS.values() if k.op is Op.DFLASH_ATTENTION}
KERNELS = {s: ALL[(s, F32, F32)] for s in KeySource}
HALF_KEYS = sorted(key for key in ALL if key[1] is not F32)


def _spec_kernels():
    """The dflash kernels the specs declare (what the build must hold)."""
    return [k for k in pipeline.checked(pipeline.parse([ROOT / "specs"], ROOT))
            if k.op is Op.DFLASH_ATTENTION]


def _np(d: IoDtype) -> np.dtype:
    return np.dtype(d.fmt.dtype)


def _rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


# ---- the references ----------------------------------------------------------------------

def _visible(i: int, n_keys: int, causal: bool, window: int) -> list[int]:
    """The definition's key set of the query at position i, one key at a time."""
    out = []
    for j in range(n_keys):
        if causal and (j > i or (window > 0 and j < i - (window - 1))):
            continue
        out.append(j)
    return out


def _one_query(q, keys, values, visible, scale):
    s = [scale * float(np.dot(q.astype(np.float64), keys[j].astype(np.float64)))
         for j in visible]
    m = max(s)
    w = [math.exp(x - m) for x in s]
    return sum(wi * values[j].astype(np.float64) for wi, j in zip(w, visible, strict=True)) \
        / sum(w)


@pytest.mark.parametrize("causal, window", [(False, 0), (True, 0), (True, 1), (True, 3),
                                            (True, -2), (True, 100), (False, 3)])
def test_dense_reference_is_the_definition(rng, causal, window):
    g, _ = rng
    lens = [1, 6, 0, 9]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T, H, Hk, D = int(cu[-1]) + 2, 4, 2, 8
    q, k, v = _rand(g, T, H, D), _rand(g, T, Hk, D), _rand(g, T, Hk, D)
    got = ref_dense(q, k, v, cu, 0.3, causal, window)
    for r, n in enumerate(lens):
        a = int(cu[r])
        for i in range(n):
            for h in range(H):
                want = _one_query(q[a + i, h], k[a:a + n, h // 2], v[a:a + n, h // 2],
                                  _visible(i, n, causal, window), 0.3)
                np.testing.assert_allclose(got[a + i, h], want, rtol=1e-12, atol=1e-12)
    assert not got[int(cu[-1]):].any()  # rows outside every request


@pytest.mark.parametrize("causal, window", [(False, 0), (True, 0), (True, 5)])
def test_paged_reference_is_the_dense_one_over_the_materialized_buffer(rng, causal, window):
    g, _ = rng
    case = Case("ref", requests=((4, 9), (3, 0), (5, 2)), n_head=4, n_head_kv=2, head_dim=8,
                block_size=4, causal=causal, sliding_window=window)
    x = tdflash.inputs(g, case, KERNELS[PAGED])
    got = ref_paged(x["q"], x["bk"], x["bv"], x["ck"], x["cv"], x["cu"], x["lens"],
                    x["table"], 0.5, causal, window)
    q, kx, vx, cu, at = tdflash.materialize(case, x, g, KERNELS[PAGED])
    dense = ref_dense(q, kx, vx, cu, 0.5, causal, window)
    np.testing.assert_allclose(got[:int(x["cu"][-1])], dense[at], rtol=1e-12, atol=1e-12)
    # and the context really is read through the table: its rows are the pages'
    r, C = 0, 9
    np.testing.assert_array_equal(gather_context(x["ck"], x["table"][r], C)[5],
                                  x["ck"][x["table"][r][1], 1])


@pytest.mark.parametrize("fi", [BF16, F16])
def test_references_widen_16bit_inputs_exactly(rng, fi):
    """16-bit inputs (bf16 bit patterns, halves) give the reference over their values."""
    g, _ = rng
    fmt = fi.fmt
    case = Case("ref", requests=((4, 9), (3, 0), (5, 2)), n_head=4, n_head_kv=2, head_dim=8,
                block_size=4, causal=True, sliding_window=3)
    x = tdflash.inputs(g, case, ALL[(PAGED, fi, fi)])
    assert x["q"].dtype == _np(fi) and x["ck"].dtype == _np(fi)
    np.testing.assert_array_equal(widen(x["q"]), fmt.dequantize_rows(x["q"]))
    wide = {n: (fmt.dequantize_rows(v) if v.dtype == _np(fi) else v) for n, v in x.items()}
    args = ("q", "bk", "bv", "ck", "cv", "cu", "lens", "table")
    np.testing.assert_array_equal(ref_paged(*(x[n] for n in args), 0.5, True, 3),
                                  ref_paged(*(wide[n] for n in args), 0.5, True, 3))
    np.testing.assert_array_equal(ref_dense(x["q"], x["bk"], x["bv"], x["cu"], 0.5, False),
                                  ref_dense(wide["q"], wide["bk"], wide["bv"], x["cu"], 0.5,
                                            False))


# ---- the GPU check, over an f32 emulation of the kernels -----------------------------------

class HostArray(np.ndarray):
    """A NumPy array with CuPy's ``get``, standing in for a device array."""

    def get(self):
        return np.asarray(self).copy()


def _fma(a, b, c):
    """f32 a * b + c rounded once (the product is exact in float64)."""
    return (np.asarray(a, np.float64) * b + c).astype(np.float32)


def _attend_row(k, qh, keys, values, scale, lo, hi, G, fault):
    """One query row (all its heads) over keys [lo, hi), as the kernel does it."""
    H, D = qh.shape
    CH = dflash_chunks(k)
    pad = CH * 32 - D
    heads = np.arange(H) // G if fault != "gqa_modulo" else np.arange(H) % keys.shape[1]
    q = np.pad(qh, ((0, 0), (0, pad))).reshape(H, CH, 32)
    kk = np.pad(keys[lo:hi][:, heads], ((0, 0), (0, 0), (0, pad))).reshape(-1, H, CH, 32)
    vv = np.pad(values[lo:hi][:, heads], ((0, 0), (0, 0), (0, pad)))
    part = np.zeros((hi - lo, H, 32), np.float32)
    for e in range(CH):
        part = _fma(q[None, :, e], kk[:, :, e], part)
    for o in (16, 8, 4, 2, 1):
        part = part + part[..., np.arange(32) ^ o]
    s = part[..., 0] * np.float32(scale)
    m = np.full(H, -np.inf, np.float32)
    l = np.zeros(H, np.float32)
    acc = np.zeros((H, CH * 32), np.float32)
    order = range(hi - lo - 1, -1, -1) if fault == "reversed_keys" else range(hi - lo)
    with np.errstate(invalid="ignore"):
        for j in order:
            m_new = np.fmax(m, s[j])
            alpha = np.exp(m - m_new)
            p = np.exp(s[j] - m_new)
            l = _fma(l, alpha, p)
            acc = _fma(p[:, None], vv[j], acc * alpha[:, None])
            m = m_new
    return (acc / l[:, None])[:, :D]


def _truncated(fo, res):
    """``res`` in ``fo``'s 16-bit elements rounded toward zero, not to nearest: a
    rounding up in magnitude is one step down (the bits are sign and magnitude)."""
    near = fo.quantize_rows(res)
    bits = near.view(np.uint16).copy()
    bits[np.abs(fo.dequantize_rows(near)) > np.abs(res)] -= 1
    return bits.view(near.dtype)


def _emulated(k, fault: str | None = None):
    """A launcher doing what templates/kernels/dflash_attention.cu.j2 does, in f32 NumPy
    (expf aside): the in_dtype elements widened, the out_dtype's rounding of each output;
    ``fault`` breaks one rule on purpose."""
    paged = k.key_source is PAGED
    fi, fo = k.in_dtype.fmt, k.out_dtype.fmt

    def fn(out, query, *arrays, block_causal, sliding_window, scale, stream=None):
        arrays = [fi.dequantize_rows(np.asarray(a)) if a.dtype == _np(k.in_dtype) else a
                  for a in arrays]
        query = fi.dequantize_rows(np.asarray(query))
        if paged:
            bk, bv, ck, cv, cu, lens, table = arrays
        else:
            bk, bv, cu = arrays
        T, H, D = out.shape
        res = np.zeros((T, H, D), np.float32)
        G = H // bk.shape[1]
        R = cu.shape[0] - 1
        for t in range(T):
            r = max([0, *(x for x in range(R) if cu[x] <= t)])
            a, b = int(cu[r]), int(cu[r + 1])
            if not (0 <= a <= t < b <= T):
                res[t] = 0.0 if fault != "pad_untouched" else np.nan
                continue
            C = int(lens[r]) if paged else 0
            if paged:
                keys = np.concatenate([gather_context(ck, table[r], C), bk[a:b]])
                values = np.concatenate([gather_context(cv, table[r], C), bv[a:b]])
            else:
                keys, values = bk[a:b], bv[a:b]
            p = C + t - a
            window = sliding_window + (1 if fault == "window_one_wider" else 0)
            hi = p + 1 if block_causal else C + b - a
            lo = max(0, p - (window - 1)) if block_causal and window > 0 else 0
            if fault == "context_ignored":
                lo = max(lo, C)
            res[t] = _attend_row(k, query[t], keys, values, scale, lo, hi, G, fault)
        out[...] = _truncated(fo, res) if fault == "truncated_output" else fo.quantize_rows(res)
    return fn


@pytest.fixture
def host_device(monkeypatch):
    """kgen.testing.dflash's device arrays as NumPy arrays, the dense kernel emulated."""
    monkeypatch.setattr(tdflash, "dev", lambda x: np.array(x).view(HostArray))
    monkeypatch.setattr(tdflash, "poisoned_as", lambda shape, fmt: np.full(
        shape, fmt.poison(), np.dtype(fmt.dtype)).view(HostArray))
    monkeypatch.setattr(tdflash, "_sync", lambda: None)
    monkeypatch.setattr(tdflash, "dense_launcher", lambda k, find: _emulated(
        ALL[(DENSE, k.in_dtype, k.out_dtype)]))


EMULATED_KEYS = 300  # the longer cases (4k, 32k keys) run on the GPU only


def _cases():
    """Every f32 kernel's cases (up to EMULATED_KEYS keys); a 16-bit kernel's at the
    engine's head sizes and the smallest (each element type pair, dense and paged)."""
    out = []
    for key, k in sorted(ALL.items()):
        for c in plan_cases(k)[0]:
            if max(b + x for b, x in c.requests) > EMULATED_KEYS:
                continue
            if key[1] is not F32 and c.head_dim not in (1, 64, 128):
                continue
            out.append(pytest.param(key, c, id="-".join(v.value for v in key) + f"-{c}"))
    return out


def test_every_kernel_of_the_specs_is_built():
    """The build holds the specs' dflash kernels: both key sources at every element type
    pair the dense and MLA ops offer (f32 / f32; 16-bit in, the same or f32 out)."""
    want = {(k.key_source, k.in_dtype, k.out_dtype): k.name for k in _spec_kernels()}
    assert {key: k.name for key, k in ALL.items()} == want
    pairs = {(i, o) for _, i, o in want}
    assert pairs == {(F32, F32)} | {(i, o) for i in (BF16, F16) for o in (i, F32)}
    assert {(s, *p) for s in KeySource for p in pairs} == set(want)


@pytest.mark.parametrize("key, case", _cases())
def test_the_gpu_check_passes_the_kernels_arithmetic(host_device, key, case):
    tdflash.check(ALL[key], _emulated(ALL[key]), case, None)


FAULTY = Case("faulty", requests=((7, 9), (5, 0), (4, 3)), n_head=4, n_head_kv=2,
              head_dim=40, block_size=4, causal=True, sliding_window=6, pad_rows=2)


@pytest.mark.parametrize("source", [DENSE, PAGED])
@pytest.mark.parametrize("io", [(F32, F32), (BF16, BF16), (F16, F32)])
@pytest.mark.parametrize("fault", ["gqa_modulo", "window_one_wider", "pad_untouched"])
def test_the_gpu_check_fails_a_kernel_that_breaks_the_definition(host_device, source, io,
                                                                 fault):
    k = ALL[(source, *io)]
    with pytest.raises(AssertionError):
        tdflash.check(k, _emulated(k, fault), FAULTY, None)


def test_the_gpu_check_fails_a_paged_kernel_that_ignores_its_context(host_device):
    with pytest.raises(AssertionError):
        tdflash.check(KERNELS[PAGED], _emulated(KERNELS[PAGED], "context_ignored"), FAULTY, None)


@pytest.mark.parametrize("io", sorted({key[1:] for key in ALL}))
def test_the_bit_identity_check_fails_another_arithmetic(host_device, monkeypatch, io):
    """Folding the same keys in another order stays within the reference's tolerance,
    but is no longer the dense kernel's bits: the check says so. A 16-bit output may
    round both orders alike, so there the paged kernel rounds toward zero instead (a
    step past the reference's allowance for rounding: that comparison is switched off
    to see the bits alone catch it)."""
    k = ALL[(PAGED, *io)]
    case = FAULTY.with_(causal=False)
    fault = "reversed_keys" if io[1] is F32 else "truncated_output"
    if fault == "truncated_output":
        monkeypatch.setattr(tdflash, "assert_close_as", lambda *a, **kw: None)
    with pytest.raises(AssertionError, match="elements differ"):
        tdflash.check(k, _emulated(k, fault), case, None)


def test_the_gpu_cases_cover_the_engines_shapes():
    for k in ALL.values():
        cases = plan_cases(k)[0]
        assert {64, 128, 256} <= {c.head_dim for c in cases}
        assert {1, 64} <= {b for c in cases for b, _ in c.requests}  # block rows
        assert {False, True} == {c.causal for c in cases}
        assert {0, 1, 3} <= {c.sliding_window for c in cases if c.causal}
        assert any(c.sliding_window < 0 for c in cases if c.causal)
        assert any(c.pad_rows for c in cases)
        assert any(c.n_head // c.n_head_kv == 8 for c in cases)
        assert any(sum(b for b, _ in c.requests) * c.n_head % DFLASH_ROWS for c in cases)
        if k.key_source is not PAGED:
            continue
        assert max(x for c in cases for _, x in c.requests) >= 32768
        assert 0 in {x for c in cases for _, x in c.requests}
        assert {1, 7, 16} <= {c.block_size for c in cases}


# ---- bind ------------------------------------------------------------------------------

def _case():
    return Case("bind", requests=((5, 7), (3, 0)), n_head=6, n_head_kv=2, head_dim=96,
                block_size=4, pad_rows=1)


@pytest.mark.parametrize("key", sorted(ALL))
def test_bind_geometry_and_defaults(key):
    source = key[0]
    k = ALL[key]
    a = tdflash.host_args(k, _case())
    b = bind(k, a)
    assert np.dtype(b.arg("out").dtype) == _np(key[2])
    for n in ("query", *(("block_key", "block_value", "ctx_key", "ctx_value")
                         if source is PAGED else ("key", "value"))):
        assert np.dtype(b.arg(n).dtype) == _np(key[1]), n
    T = 9
    assert b.grid == (-(-T * 6 // DFLASH_ROWS), 1, 1) and b.block == (dflash_threads(), 1, 1)
    assert b.shared_bytes == 0
    assert [int(b.arg(n)) for n in ("n_rows", "n_head", "n_head_kv", "head_dim", "num_reqs")] \
        == [T, 6, 2, 96, 2]
    assert float(b.arg("scale")) == np.float32(1 / math.sqrt(96))
    a.pop("block_causal"), a.pop("sliding_window")
    b = bind(k, a)
    assert int(b.arg("block_causal")) == PARAMS["block_causal"].default
    assert int(b.arg("sliding_window")) == PARAMS["sliding_window"].default
    if source is PAGED:
        nb, mb = tdflash.page_shape(_case())
        assert [int(b.arg(n)) for n in ("block_size", "max_blocks", "num_pages")] == [4, mb, nb]


def test_bind_ranges():
    k = KERNELS[DENSE]
    a = tdflash.host_args(k, _case())
    for ok in (INT_MAX, -INT_MAX - 1, 0, 1, -1):
        assert int(bind(k, {**a, "sliding_window": ok}).arg("sliding_window")) == ok
    for name, bad, contract in (("block_causal", -1, "range"), ("block_causal", 2, "range"),
                                ("block_causal", True, "type"), ("scale", -1.0, "scale")):
        with pytest.raises(ContractError) as e:
            bind(k, {**a, name: bad})
        assert e.value.contract == contract
    with pytest.raises(ContractError) as e:
        bind(k, tdflash.host_args(k, _case().with_(head_dim=k.max_head_dim + 1)))
    assert e.value.contract == "head_dim range"
    bind(k, tdflash.host_args(k, _case().with_(head_dim=k.max_head_dim)))


# ---- the runtime's entry points, with CuPy a stand-in ------------------------------------

@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(runtime_dflash, "_CHOSEN", {})
    return FakeCupy().install(monkeypatch)


def _dense_args(cp, cu=(0, 5, 8), T=9, H=6, Hk=2, D=128):
    return (cp.empty((T, H, D)), cp.empty((T, H, D)), cp.empty((T, Hk, D)),
            cp.empty((T, Hk, D)), cp.asarray(np.array(cu, np.int32)))


def _paged_args(cp, lens=(7, 0), table=((3, 0), (-1, -1)), pages=4, bs=4, **kw):
    out, q, bk, bv, cu = _dense_args(cp, **kw)
    Hk, D = bk.shape[1:]
    return (out, q, bk, bv, cp.empty((pages, bs, Hk, D)), cp.empty((pages, bs, Hk, D)), cu,
            cp.asarray(np.array(lens, np.int32)), cp.asarray(np.array(table, np.int32)))


def test_dense_entry_point_launches_the_dense_kernel(cp):
    args = _dense_args(cp)
    b = dflash_block_attention(*args, scale=0.125, causal=True, window_size=(2, 0), num_reqs=2)
    (name, grid, block, _, shared, _), = cp.launched
    assert name == b.kernel == KERNELS[DENSE].name
    assert grid == (-(-9 * 6 // DFLASH_ROWS), 1, 1) and block == (dflash_threads(), 1, 1)
    assert shared == 0
    for n, x in zip(("out", "query", "key", "value", "cu_seqlens"), args, strict=True):
        assert b.arg(n) is x
    assert int(b.arg("block_causal")) == 1 and int(b.arg("sliding_window")) == 3
    assert float(b.arg("scale")) == np.float32(0.125)
    b = dflash_block_attention(*args, scale=0.125)
    assert int(b.arg("block_causal")) == PARAMS["block_causal"].default


def test_paged_entry_point_launches_the_paged_kernel(cp):
    args = _paged_args(cp)
    b = dflash_paged_block_attention(*args, scale=0.125, causal=False, num_reqs=2,
                                     block_size=4)
    (name, grid, block, _, _, _), = cp.launched
    assert name == b.kernel == KERNELS[PAGED].name
    assert grid == (-(-9 * 6 // DFLASH_ROWS), 1, 1) and block == (dflash_threads(), 1, 1)
    names = ("out", "query", "block_key", "block_value", "ctx_key", "ctx_value",
             "cu_seqlens", "seq_lens", "block_table")
    for n, x in zip(names, args, strict=True):
        assert b.arg(n) is x
    assert [int(b.arg(n)) for n in ("block_size", "max_blocks", "num_pages", "num_reqs")] \
        == [4, 2, 4, 2]


def test_entry_points_refuse_before_launching(cp):
    dense = [
        ("cu_seqlens", dict(cu=(0, 6, 5))),        # falls
        ("cu_seqlens", dict(cu=(0, 5, 10))),       # past the 9 query rows
        ("cu_seqlens", dict(cu=(-1, 5, 8))),
    ]
    for contract, kw in dense:
        with pytest.raises(ContractError) as e:
            dflash_block_attention(*_dense_args(cp, **kw), scale=0.1)
        assert e.value.contract == contract, (kw, e.value)
    paged = [
        ("seq_lens", dict(lens=(9, 0))),                    # past the table's 2 x 4
        ("seq_lens", dict(lens=(-1, 0))),
        ("block_table", dict(table=((3, 4), (-1, -1)))),    # page 4 of 4
        ("block_table", dict(lens=(7, 1))),                 # request 1 maps page -1
        ("cu_seqlens", dict(cu=(0, 9, 8))),
    ]
    for contract, kw in paged:
        with pytest.raises(ContractError) as e:
            dflash_paged_block_attention(*_paged_args(cp, **kw), scale=0.1)
        assert e.value.contract == contract, (kw, e.value)
    calls = [
        ("shape", lambda: dflash_block_attention(*_dense_args(cp), scale=0.1, num_reqs=3)),
        ("shape", lambda: dflash_paged_block_attention(*_paged_args(cp), scale=0.1,
                                                       block_size=8)),
        ("type", lambda: dflash_block_attention(*_dense_args(cp), scale=0.1, causal=2)),
        ("type", lambda: dflash_block_attention(*_dense_args(cp), scale=0.1, validate=1)),
        ("window_size", lambda: dflash_block_attention(*_dense_args(cp), scale=0.1,
                                                       window_size=(INT_MAX + 1, 0))),
        ("window_size", lambda: dflash_block_attention(*_dense_args(cp), scale=0.1,
                                                       causal=True, window_size=(4, 2))),
        ("window_size", lambda: dflash_block_attention(*_dense_args(cp), scale=0.1,
                                                       window_size=(4, 0))),
        ("window_size", lambda: dflash_block_attention(*_dense_args(cp), scale=0.1,
                                                       causal=True, window_size=5)),
        ("scale", lambda: dflash_block_attention(*_dense_args(cp), scale=float("nan"))),
        ("GQA", lambda: dflash_block_attention(*_dense_args(cp, H=5), scale=0.1)),
        ("no kernel", lambda: dflash_block_attention(*_dense_args(cp, D=512), scale=0.1)),
        ("device", lambda: dflash_block_attention(
            *_dense_args(cp)[:4], np.array([0, 5, 8], np.int32), scale=0.1)),
    ]
    for contract, call in calls:
        with pytest.raises(ContractError) as e:
            call()
        assert e.value.contract == contract, (contract, e.value)
    assert cp.launched == []


def test_validate_false_reads_no_index_array(cp):
    """A graph-captured call owns the index contents: nothing is read back (the kernel
    keeps every read in bounds whatever they hold)."""
    args = list(_paged_args(cp, lens=(99, 0)))

    class Unread(FakeArray):
        def get(self, stream=None):
            raise AssertionError("an index array was read back")
    args[6:9] = [Unread(a.shape, a.dtype) for a in args[6:9]]
    dflash_paged_block_attention(*args, scale=0.1, validate=False)
    assert len(cp.launched) == 1


def test_entry_point_variant_must_serve_the_call(cp):
    with pytest.raises(ContractError, match="cannot serve") as e:
        dflash_block_attention(*_dense_args(cp), scale=0.1, variant=KERNELS[PAGED].name)
    assert e.value.contract == "variant"
    b = dflash_block_attention(*_dense_args(cp), scale=0.1, variant=KERNELS[DENSE].name)
    assert b.kernel == KERNELS[DENSE].name


# ---- element types: the kernels, their parameters and source, the entry points' choice ----

@pytest.mark.parametrize("key", sorted(ALL))
def test_parameters_take_the_kernels_element_types(key):
    """out of out_dtype, query and every key / value array of in_dtype (the formats' C
    types); the index arrays and scalars as the f32 kernel's."""
    k, base = ALL[key], KERNELS[key[0]]
    ti, to = key[1].fmt.ctype, key[2].fmt.ctype
    mine, theirs = params(k), params(base)
    assert [p.name for p in mine] == [p.name for p in theirs]
    for p, q in zip(mine, theirs, strict=True):
        if p.name == "out":
            assert (p.ctype, p.dtype) == (f"{to} *", key[2].fmt.dtype)
        elif q.ctype == "const float *":
            assert (p.ctype, p.dtype) == (f"const {ti} *", key[1].fmt.dtype), p
        else:
            assert p == q


def _unconverted(body: str, k) -> str:
    """A kernel body with its element conversions taken away (each conversion call
    replaced by its argument) and its element C types spelled float."""
    for fmt in {k.in_dtype.fmt, k.out_dtype.fmt}:
        if fmt is F32.fmt:
            continue
        for fn in {BF16.fmt: ("kgen_bf16_to_float", "kgen_float_to_bf16"),
                   F16.fmt: ("__half2float", "__float2half")}[fmt]:
            body = re.sub(rf"\b{fn}\(((?:[^()]|\([^()]*\))*)\)", r"\1", body)
        body = re.sub(rf"\b{re.escape(fmt.ctype)} \*", "float *", body)
    return body


def test_16bit_kernels_are_the_f32_kernels_with_conversions():
    """Rendered from the specs: a 16-bit kernel's body is its key source's f32 kernel's,
    every element read widened (q, K, V: in_dtype) and every output write rounded (zeros,
    NaN rows, the result: out_dtype) by the formats' conversions, and nothing else."""
    units = {u.name: u.source for u in render_units(_spec_kernels(), ROOT / "templates", ROOT)}

    def body(k):
        src = units[k.name]
        return src[src.index("{", src.index(f"__global__ void {k.name}(")):]
    conversions = {F32: (0, 0), BF16: ("kgen_bf16_to_float(", "kgen_float_to_bf16("),
                   F16: ("__half2float(", "__float2half(")}
    f32 = {s: body(KERNELS[s]) for s in KeySource}
    for s in f32.values():
        assert not any(c in s for v in conversions.values() for c in v if c)
    for key in HALF_KEYS:
        k = ALL[key]
        b = body(k)
        assert _unconverted(b, k) == f32[key[0]], k.name
        assert b.count(conversions[key[1]][0]) == 3  # q, K and V elements
        if key[2] is not F32:  # zero rows, (paged) NaN rows, the output
            writes = f32[key[0]].count("o_row[lane + 32 * e] = ")
            assert b.count(conversions[key[2]][1]) == writes == (3 if key[0] is PAGED else 2)


def _typed(cp, args, fi, fo):
    """Dense or paged arguments with query and the key / value arrays of ``fi``'s NumPy
    type, out of ``fo``'s (the index arrays as they were)."""
    out = [cp.empty(args[0].shape, _np(fo))]
    out += [a if a.dtype == np.int32 else cp.empty(a.shape, _np(fi)) for a in args[1:]]
    return tuple(out)


@pytest.mark.parametrize("key", sorted(ALL))
def test_entry_points_launch_the_kernel_of_their_dtypes(cp, key):
    source, fi, fo = key
    entry = dflash_paged_block_attention if source is PAGED else dflash_block_attention
    args = _typed(cp, _paged_args(cp) if source is PAGED else _dense_args(cp), fi, fo)
    b = entry(*args, scale=0.125, causal=True, window_size=(2, 0))
    (name, grid, block, _, _, _), = cp.launched
    assert name == b.kernel == ALL[key].name
    assert grid == (-(-9 * 6 // DFLASH_ROWS), 1, 1) and block == (dflash_threads(), 1, 1)
    names = ("out", "query", "block_key", "block_value", "ctx_key", "ctx_value",
             "cu_seqlens", "seq_lens", "block_table") if source is PAGED else \
        ("out", "query", "key", "value", "cu_seqlens")
    for n, x in zip(names, args, strict=True):
        assert b.arg(n) is x
    # the choice kept per element types: another pair chooses again
    other = next(k for k in sorted(ALL) if k[0] is source and k != key)
    entry(*_typed(cp, args, *other[1:]), scale=0.125)
    assert cp.launched[-1][0] == ALL[other].name


def test_entry_points_refuse_mixed_or_unserved_element_types(cp):
    """One element type for query and every key / value array, out f32 or that type: a
    break is refused (dtype) before any launch, naming the array."""
    u16, f16, f32 = np.uint16, np.float16, np.float32
    dense, paged = _dense_args(cp), _paged_args(cp)

    def with_(args, i, dt):
        return tuple(cp.empty(a.shape, dt) if j == i else a for j, a in enumerate(args))
    calls = [
        # a 16-bit output of other inputs: refused by the entry point itself
        ("out holds f16 elements", lambda: dflash_block_attention(
            *_typed(cp, dense, BF16, F16), scale=0.1)),
        ("out holds bf16 elements", lambda: dflash_paged_block_attention(
            *_typed(cp, paged, F32, BF16), scale=0.1)),
        ("out holds bf16 elements", lambda: dflash_block_attention(
            *_typed(cp, dense, F16, BF16), scale=0.1)),
        # a key, value or context array of another type than query's: bind refuses it
        ("key must be float32, not uint16", lambda: dflash_block_attention(
            *with_(dense, 2, u16), scale=0.1)),
        ("value must be uint16, not float16", lambda: dflash_block_attention(
            *with_(_typed(cp, dense, BF16, F32), 3, f16), scale=0.1)),
        ("ctx_value must be float16, not uint16", lambda: dflash_paged_block_attention(
            *with_(_typed(cp, paged, F16, F16), 5, u16), scale=0.1)),
        ("block_key must be uint16, not float32", lambda: dflash_paged_block_attention(
            *with_(_typed(cp, paged, BF16, BF16), 2, f32), scale=0.1)),
        # no element type at all
        ("query must be one of", lambda: dflash_block_attention(
            *with_(dense, 1, np.float64), scale=0.1)),
        ("out must be one of", lambda: dflash_paged_block_attention(
            *with_(paged, 0, np.int32), scale=0.1)),
    ]
    for says, call in calls:
        with pytest.raises(ContractError) as e:
            call()
        assert e.value.contract == "dtype" and says in str(e.value), (says, e.value)
    assert cp.launched == []


def test_bf16_and_f16_are_the_formats():
    """The kernels' 16-bit elements are kgen.formats' (in_dtype / out_dtype name them)."""
    assert {d.fmt for d in (BF16, F16)} == {FORMATS["bf16"], FORMATS["f16"]}
    assert {_np(d) for d in IoDtype} == {np.dtype(np.float32), np.dtype(np.uint16),
                                         np.dtype(np.float16)}
