"""dense_attention (the engine's AttentionDenseFast / AttentionDenseFlash) without a
GPU: the float64 reference against the definition, one query at a time; the generated
GPU check and the Fast == Flash relation check run over an f32 emulation of the
kernels' arithmetic (lanes, butterfly, one key folded at a time, bf16 widened exactly
and rounded to nearest even): its tolerances hold for that arithmetic, and a kernel
that breaks the definition, or folds its keys in another order, fails them; bind's
geometry, defaults and ranges; the entry points with CuPy replaced by a stand-in
(kernel choice by the arrays' element types, refusals before a launch).

Random inputs are fresh each run (KGEN_TEST_SEED=<seed> replays one)."""

from __future__ import annotations

import math

import kgen_kernels
import numpy as np
import pytest

from kgen.formats import FORMATS
from kgen.formats import bf16 as fbf16
from kgen.ir.axes import IoDtype, KvReads, Op
from kgen.ir.geometry import DENSE_ROWS, dense_shared_bytes, dense_threads, dflash_chunks
from kgen.ir.params import PARAMS
from kgen.numpy_ref import attention_dense as ref_dense
from kgen.runtime import ContractError, attention_dense_fast, attention_dense_flash, bind
from kgen.runtime import attention_dense as runtime_dense
from kgen.testing import dense as tdense
from kgen.testing.case import Case
from kgen.testing.fakecupy import FakeCupy
from kgen.testing.testgen import plan_cases

KERNELS = {(k.kv_reads, k.in_dtype, k.out_dtype): k for mod in kgen_kernels.MODULES.values()
           for k in mod.KERNELS.values() if k.op is Op.DENSE_ATTENTION}
F32, BF16 = IoDtype.F32, IoDtype.BF16
FAST, FLASH = KvReads.GLOBAL, KvReads.SHARED_TILE


def _rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


# ---- the reference -----------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_reference_is_the_definition(rng, causal):
    g, _ = rng
    T, H, Hk, D = 11, 6, 2, 24
    q, k, v = _rand(g, T, H, D), _rand(g, T, Hk, D), _rand(g, T, Hk, D)
    scale = 0.3
    got = ref_dense(q, k, v, scale, causal)
    for t in range(T):
        keys = range(t + 1) if causal else range(T)
        for h in range(H):
            qh = q[t, h].astype(np.float64)
            s = np.array([scale * float(np.dot(qh, k[j, h // 3])) for j in keys])
            w = np.exp(s - s.max())
            w /= w.sum()
            want = sum(wj * v[j, h // 3].astype(np.float64) for wj, j in zip(w, keys,
                                                                              strict=True))
            np.testing.assert_allclose(got[t, h], want, rtol=1e-12, atol=1e-12)


# ---- the GPU checks, over an f32 emulation of the kernels ---------------------------------

class HostArray(np.ndarray):
    """A NumPy array with CuPy's ``get``, standing in for a device array."""

    def get(self):
        return np.asarray(self).copy()


def _fma(a, b, c):
    """f32 a * b + c rounded once (the product is exact in float64)."""
    return (np.asarray(a, np.float64) * b + c).astype(np.float32)


def _emulated(k, fault: str | None = None):
    """A launcher doing what templates/kernels/dense_attention.cu.j2 does, in f32 NumPy
    (expf aside); ``fault`` breaks one rule on purpose."""
    fi, fo = k.in_dtype.fmt, k.out_dtype.fmt

    def fn(out, query, key, value, *, block_causal, scale, stream=None):
        q, kk, vv = (fi.dequantize_rows(np.asarray(x)) for x in (query, key, value))
        T, H, D = q.shape
        G = H // kk.shape[1]
        CH = dflash_chunks(k)
        pad = CH * 32 - D
        heads = np.arange(H) // G if fault != "gqa_modulo" else np.arange(H) % kk.shape[1]
        res = np.empty((T, H, D), np.float32)
        for t in range(T):
            hi = t + 1 if block_causal else T
            if fault == "causal_one_more" and block_causal:
                hi = min(T, t + 2)
            qt = np.pad(q[t], ((0, 0), (0, pad))).reshape(H, CH, 32)
            kt = np.pad(kk[:hi][:, heads], ((0, 0), (0, 0), (0, pad))).reshape(-1, H, CH, 32)
            vt = np.pad(vv[:hi][:, heads], ((0, 0), (0, 0), (0, pad)))
            part = np.zeros((hi, H, 32), np.float32)
            for e in range(CH):
                part = _fma(qt[None, :, e], kt[:, :, e], part)
            for o in (16, 8, 4, 2, 1):
                part = part + part[..., np.arange(32) ^ o]
            s = part[..., 0] * np.float32(scale)
            m = np.full(H, -np.inf, np.float32)
            l = np.zeros(H, np.float32)
            acc = np.zeros((H, CH * 32), np.float32)
            order = range(hi - 1, -1, -1) if fault == "reversed_keys" else range(hi)
            with np.errstate(invalid="ignore"):
                for j in order:
                    m_new = np.fmax(m, s[j])
                    alpha = np.exp(m - m_new)
                    p = np.exp(s[j] - m_new)
                    l = _fma(l, alpha, p)
                    acc = _fma(p[:, None], vt[j], acc * alpha[:, None])
                    m = m_new
            res[t] = (acc / l[:, None])[:, :D]
        rows = fo.quantize_rows(res)
        if fault == "truncated_output" and rows.dtype == np.uint16:  # bf16: toward zero
            rows = (res.view(np.uint32) >> 16).astype(np.uint16)
        if fault == "last_row_untouched":
            rows = rows[:-1]
        out[: rows.shape[0]] = rows
    return fn


@pytest.fixture
def host_device(monkeypatch):
    """kgen.testing.dense's device arrays as NumPy arrays."""
    monkeypatch.setattr(tdense, "dev", lambda x: np.array(x).view(HostArray))
    monkeypatch.setattr(tdense, "poisoned", lambda shape, dtype: np.zeros(shape, dtype)
                        .view(HostArray))
    monkeypatch.setattr(tdense, "_sync", lambda: None)


EMULATED_ROWS = 300  # the 1500-frame cases run on the GPU only


def _cases():
    return [pytest.param(key, c, id=f"{key[0].value}-{key[1].value}-{key[2].value}-{c}")
            for key, k in sorted(KERNELS.items()) for c in plan_cases(k)[0]
            if c.n <= EMULATED_ROWS and c.n * c.n_head <= 300 * 8]


def test_every_kernel_is_built():
    assert set(KERNELS) == {(r, i, o) for r in (FAST, FLASH)
                            for i, o in ((F32, F32), (BF16, BF16), (BF16, F32))}


@pytest.mark.parametrize("key, case", _cases())
def test_the_gpu_check_passes_the_kernels_arithmetic(host_device, key, case):
    tdense.check(KERNELS[key], _emulated(KERNELS[key]), case)


FAULTY = Case("faulty", n=9, n_head=4, n_head_kv=2, head_dim=40, causal=True)


@pytest.mark.parametrize("key", [(FAST, F32, F32), (FLASH, BF16, BF16), (FAST, BF16, F32)])
@pytest.mark.parametrize("fault", ["gqa_modulo", "causal_one_more", "last_row_untouched"])
def test_the_gpu_check_fails_a_kernel_that_breaks_the_definition(host_device, key, fault):
    with pytest.raises(AssertionError):
        tdense.check(KERNELS[key], _emulated(KERNELS[key], fault), FAULTY)


@pytest.mark.parametrize("io", [(F32, F32), (BF16, BF16), (BF16, F32)])
def test_the_relation_check(host_device, io):
    """Fast and Flash on the same inputs: the same arithmetic gives the same bits; the
    same keys folded in another order stay within the reference's tolerance, but are
    no longer the Fast kernel's bits, and the check says so."""
    fast, flash = KERNELS[(FAST, *io)], KERNELS[(FLASH, *io)]
    case = FAULTY.with_(causal=False, n=40)
    tdense.relation("bit_exact", 0.0, flash, _emulated(flash), fast, _emulated(fast), case)
    # f32 out: another key order; bf16 out (which may round both orders alike): the
    # output truncated instead of rounded to nearest even
    fault = "truncated_output" if io[1] is BF16 else "reversed_keys"
    if fault == "reversed_keys":
        tdense.check(flash, _emulated(flash, fault), case)
    with pytest.raises(AssertionError, match="elements differ"):
        tdense.relation("bit_exact", 0.0, flash, _emulated(flash, fault), fast,
                        _emulated(fast), case)


def test_the_gpu_cases_cover_the_engines_shapes():
    for k in KERNELS.values():
        cases = plan_cases(k)[0]
        assert {64, 72, 80, 128} <= {c.head_dim for c in cases}
        assert {False, True} == {c.causal for c in cases}
        assert max(c.n for c in cases) >= 1500
        assert any(c.n // k.tile_keys >= 2 and c.n % k.tile_keys for c in cases)
        assert any(c.n_head // c.n_head_kv == 8 for c in cases)
        assert any(c.n * (c.n_head // c.n_head_kv) % DENSE_ROWS for c in cases)
        assert any(DENSE_ROWS % (c.n_head // c.n_head_kv) for c in cases)


def test_bf16_rounding_is_the_formats():
    """The kernels' bf16 elements are kgen.formats.bf16's (round to nearest even)."""
    assert FORMATS[BF16.value] is fbf16.FORMAT
    x = np.array([1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -2.5], np.float32)
    np.testing.assert_array_equal(fbf16.decode(fbf16.encode(x)),
                                  np.array([1.0, 1.0, 1.0 + 2.0**-6, -2.5], np.float32))


# ---- bind ------------------------------------------------------------------------------

def _case():
    return Case("bind", n=9, n_head=6, n_head_kv=2, head_dim=96)


@pytest.mark.parametrize("key", sorted(KERNELS))
def test_bind_geometry_and_defaults(key):
    k = KERNELS[key]
    a = tdense.host_args(k, _case())
    b = bind(k, a)
    assert b.grid == (-(-9 * 3 // DENSE_ROWS), 2, 1) and b.block == (dense_threads(), 1, 1)
    assert b.shared_bytes == 0  # the tiles are static
    assert dense_shared_bytes(k) == (2 * k.tile_keys * k.max_head_dim * 4
                                     if key[0] is FLASH else 0)
    assert [int(b.arg(n)) for n in ("n_rows", "n_head", "n_head_kv", "head_dim")] \
        == [9, 6, 2, 96]
    assert np.dtype(b.arg("query").dtype) == np.dtype(key[1].fmt.dtype)
    assert np.dtype(b.arg("out").dtype) == np.dtype(key[2].fmt.dtype)
    a.pop("block_causal"), a.pop("scale")
    b = bind(k, a)
    assert int(b.arg("block_causal")) == PARAMS["block_causal"].default
    assert float(b.arg("scale")) == np.float32(1 / math.sqrt(96))


def test_bind_ranges():
    k = KERNELS[(FLASH, F32, F32)]
    a = tdense.host_args(k, _case())
    for name, bad, contract in (("block_causal", -1, "range"), ("block_causal", 2, "range"),
                                ("block_causal", True, "type"), ("scale", 0.0, "scale"),
                                ("scale", float("inf"), "scale")):
        with pytest.raises(ContractError) as e:
            bind(k, {**a, name: bad})
        assert e.value.contract == contract
    with pytest.raises(ContractError) as e:
        bind(k, tdense.host_args(k, _case().with_(head_dim=k.max_head_dim + 1)))
    assert e.value.contract == "head_dim range"
    bind(k, tdense.host_args(k, _case().with_(head_dim=k.max_head_dim)))
    bind(k, tdense.host_args(k, _case().with_(head_dim=1)))


# ---- the runtime's entry points, with CuPy a stand-in ------------------------------------

@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(runtime_dense, "_CHOSEN", {})
    return FakeCupy().install(monkeypatch)


def _args(cp, T=9, H=6, Hk=2, D=72, dt=np.float32, out_dt=None):
    return (cp.empty((T, H, D), out_dt or dt), cp.empty((T, H, D), dt), cp.empty((T, Hk, D), dt),
            cp.empty((T, Hk, D), dt))


@pytest.mark.parametrize("entry, reads", [(attention_dense_fast, FAST),
                                          (attention_dense_flash, FLASH)])
@pytest.mark.parametrize("dt, out_dt", [(np.float32, np.float32), (np.uint16, np.uint16),
                                        (np.uint16, np.float32)])
def test_entry_points_launch_the_kernel_of_their_dtypes(cp, entry, reads, dt, out_dt):
    args = _args(cp, dt=dt, out_dt=out_dt)
    b = entry(*args, scale=0.125, causal=True)
    (name, grid, block, _, shared, _), = cp.launched
    io = tuple(d for x in (dt, out_dt) for d in IoDtype if np.dtype(d.fmt.dtype) == x)
    assert name == b.kernel == KERNELS[(reads, *io)].name
    assert grid == (-(-9 * 3 // DENSE_ROWS), 2, 1) and block == (dense_threads(), 1, 1)
    assert shared == 0
    for n, x in zip(("out", "query", "key", "value"), args, strict=True):
        assert b.arg(n) is x
    assert int(b.arg("block_causal")) == 1 and float(b.arg("scale")) == np.float32(0.125)
    b = entry(*args)
    assert int(b.arg("block_causal")) == 0
    assert float(b.arg("scale")) == np.float32(1 / math.sqrt(72))


def test_entry_points_refuse_before_launching(cp):
    f32, u16 = np.float32, np.uint16
    calls = [
        ("type", lambda e: e(*_args(cp), scale=0.1, causal=2)),
        ("dtype", lambda e: e(*_args(cp, dt=np.float64), scale=0.1)),
        # float16 is an element type (IoDtype f16, the MLA ops'), no dense kernel's
        ("no kernel", lambda e: e(*_args(cp, dt=np.float16), scale=0.1)),
        ("dtype", lambda e: e(*_args(cp, dt=f32, out_dt=np.float64), scale=0.1)),
        ("dtype", lambda e: e(*_args(cp)[:3], cp.empty((9, 2, 72), u16), scale=0.1)),
        ("array", lambda e: e(*_args(cp)[:1], [[0.0]], *_args(cp)[2:], scale=0.1)),
        ("scale", lambda e: e(*_args(cp), scale=float("nan"))),
        ("scale", lambda e: e(*_args(cp), scale=-0.5)),
        ("GQA", lambda e: e(*_args(cp, H=5), scale=0.1)),
        ("shape", lambda e: e(*_args(cp)[:2], cp.empty((8, 2, 72)), _args(cp)[3], scale=0.1)),
        ("shape", lambda e: e(cp.empty((9, 6, 71)), *_args(cp)[1:], scale=0.1)),
        ("no kernel", lambda e: e(*_args(cp, D=129), scale=0.1)),
        ("no kernel", lambda e: e(*_args(cp, dt=f32, out_dt=u16), scale=0.1)),
    ]
    for entry in (attention_dense_fast, attention_dense_flash):
        for contract, call in calls:
            with pytest.raises(ContractError) as e:
                call(entry)
            assert e.value.contract == contract, (contract, e.value)
    assert cp.launched == []


def test_entry_point_variant_must_serve_the_call(cp):
    with pytest.raises(ContractError, match="cannot serve") as e:
        attention_dense_fast(*_args(cp), variant=KERNELS[(FLASH, F32, F32)].name)
    assert e.value.contract == "variant"
    b = attention_dense_flash(*_args(cp), variant=KERNELS[(FLASH, F32, F32)].name)
    assert b.kernel == KERNELS[(FLASH, F32, F32)].name
