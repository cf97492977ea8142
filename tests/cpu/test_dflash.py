"""dflash_attention (the engine's DFlash block attention) without a GPU: the float64
references against the definition, one query at a time, and the paged one against the
dense one over the materialized [context ; block]; the generated GPU check run over an
f32 emulation of the kernels' arithmetic (lanes, butterfly, one key folded at a time:
its tolerances hold for that arithmetic, and a kernel that breaks the definition, or
the paged kernel's bit-identity with the dense one, fails it); bind's geometry,
defaults and ranges; the runtime's entry points with CuPy replaced by a stand-in
(kernel choice, arguments, the index arrays checked on the host, refusals before a
launch).

Random inputs are fresh each run (KGEN_TEST_SEED=<seed> replays one)."""

from __future__ import annotations

import math

import kgen_kernels
import numpy as np
import pytest

from kgen.ir.axes import KeySource, Op
from kgen.ir.geometry import DFLASH_ROWS, dflash_chunks, dflash_threads
from kgen.ir.params import INT_MAX, PARAMS
from kgen.numpy_ref import dflash_block_attention as ref_dense
from kgen.numpy_ref import dflash_paged_block_attention as ref_paged
from kgen.numpy_ref.dflash import gather_context
from kgen.runtime import ContractError, bind, dflash_block_attention, dflash_paged_block_attention
from kgen.runtime import dflash as runtime_dflash
from kgen.testing import dflash as tdflash
from kgen.testing.case import Case
from kgen.testing.fakecupy import FakeArray, FakeCupy
from kgen.testing.testgen import plan_cases

KERNELS = {k.key_source: k for mod in kgen_kernels.MODULES.values()
           for k in mod.KERNELS.values() if k.op is Op.DFLASH_ATTENTION}
DENSE, PAGED = KeySource.DENSE, KeySource.PAGED


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
    q, kx, vx, cu, at = tdflash.materialize(case, x, g)
    dense = ref_dense(q, kx, vx, cu, 0.5, causal, window)
    np.testing.assert_allclose(got[:int(x["cu"][-1])], dense[at], rtol=1e-12, atol=1e-12)
    # and the context really is read through the table: its rows are the pages'
    r, C = 0, 9
    np.testing.assert_array_equal(gather_context(x["ck"], x["table"][r], C)[5],
                                  x["ck"][x["table"][r][1], 1])


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


def _emulated(k, fault: str | None = None):
    """A launcher doing what templates/kernels/dflash_attention.cu.j2 does, in f32 NumPy
    (expf aside); ``fault`` breaks one rule on purpose."""
    paged = k.key_source is PAGED

    def fn(out, query, *arrays, block_causal, sliding_window, scale, stream=None):
        if paged:
            bk, bv, ck, cv, cu, lens, table = arrays
        else:
            bk, bv, cu = arrays
        T, H, D = out.shape
        G = H // bk.shape[1]
        R = cu.shape[0] - 1
        for t in range(T):
            r = max([0, *(x for x in range(R) if cu[x] <= t)])
            a, b = int(cu[r]), int(cu[r + 1])
            if not (0 <= a <= t < b <= T):
                out[t] = 0.0 if fault != "pad_untouched" else np.nan
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
            out[t] = _attend_row(k, query[t], keys, values, scale, lo, hi, G, fault)
    return fn


@pytest.fixture
def host_device(monkeypatch):
    """kgen.testing.dflash's device arrays as NumPy arrays, the dense kernel emulated."""
    monkeypatch.setattr(tdflash, "dev", lambda x: np.array(x).view(HostArray))
    monkeypatch.setattr(tdflash, "poisoned", lambda shape: np.full(shape, np.nan, np.float32)
                        .view(HostArray))
    monkeypatch.setattr(tdflash, "_sync", lambda: None)
    monkeypatch.setattr(tdflash, "dense_launcher", lambda k: _emulated(KERNELS[DENSE]))


EMULATED_KEYS = 300  # the longer cases (4k, 32k keys) run on the GPU only


def _cases():
    return [pytest.param(s, c, id=f"{s.value}-{c}") for s, k in sorted(KERNELS.items())
            for c in plan_cases(k)[0] if max(b + x for b, x in c.requests) <= EMULATED_KEYS]


def test_both_kernels_are_built():
    assert set(KERNELS) == {DENSE, PAGED}


@pytest.mark.parametrize("source, case", _cases())
def test_the_gpu_check_passes_the_kernels_arithmetic(host_device, source, case):
    tdflash.check(KERNELS[source], _emulated(KERNELS[source]), case)


FAULTY = Case("faulty", requests=((7, 9), (5, 0), (4, 3)), n_head=4, n_head_kv=2,
              head_dim=40, block_size=4, causal=True, sliding_window=6, pad_rows=2)


@pytest.mark.parametrize("source", [DENSE, PAGED])
@pytest.mark.parametrize("fault", ["gqa_modulo", "window_one_wider", "pad_untouched"])
def test_the_gpu_check_fails_a_kernel_that_breaks_the_definition(host_device, source, fault):
    with pytest.raises(AssertionError):
        tdflash.check(KERNELS[source], _emulated(KERNELS[source], fault), FAULTY)


def test_the_gpu_check_fails_a_paged_kernel_that_ignores_its_context(host_device):
    with pytest.raises(AssertionError):
        tdflash.check(KERNELS[PAGED], _emulated(KERNELS[PAGED], "context_ignored"), FAULTY)


def test_the_bit_identity_check_fails_another_key_order(host_device):
    """Folding the same keys in another order stays within the reference's tolerance,
    but is no longer the dense kernel's bits: the check says so."""
    k = KERNELS[PAGED]
    case = FAULTY.with_(causal=False)
    with pytest.raises(AssertionError, match="floats differ"):
        tdflash.check(k, _emulated(k, "reversed_keys"), case)


def test_the_gpu_cases_cover_the_engines_shapes():
    for source in (DENSE, PAGED):
        cases = plan_cases(KERNELS[source])[0]
        assert {64, 128, 256} <= {c.head_dim for c in cases}
        assert {1, 64} <= {b for c in cases for b, _ in c.requests}  # block rows
        assert {False, True} == {c.causal for c in cases}
        assert {0, 1, 3} <= {c.sliding_window for c in cases if c.causal}
        assert any(c.sliding_window < 0 for c in cases if c.causal)
        assert any(c.pad_rows for c in cases)
        assert any(c.n_head // c.n_head_kv == 8 for c in cases)
        assert any(sum(b for b, _ in c.requests) * c.n_head % DFLASH_ROWS for c in cases)
    paged = plan_cases(KERNELS[PAGED])[0]
    assert max(x for c in paged for _, x in c.requests) >= 32768
    assert 0 in {x for c in paged for _, x in c.requests}
    assert {1, 7, 16} <= {c.block_size for c in paged}


# ---- bind ------------------------------------------------------------------------------

def _case():
    return Case("bind", requests=((5, 7), (3, 0)), n_head=6, n_head_kv=2, head_dim=96,
                block_size=4, pad_rows=1)


@pytest.mark.parametrize("source", [DENSE, PAGED])
def test_bind_geometry_and_defaults(source):
    k = KERNELS[source]
    a = tdflash.host_args(k, _case())
    b = bind(k, a)
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
    b = dflash_block_attention(*args, scale=0.125, causal=True, sliding_window=3, num_reqs=2)
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
        ("range", lambda: dflash_block_attention(*_dense_args(cp), scale=0.1,
                                                 sliding_window=INT_MAX + 1)),
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
