"""The multi-head latent attention ops without a GPU: the NumPy definitions against
each other (split partials merged = the direct decode, stored rows gathered back), the
split rule, the generated GPU checks run over f32 emulations of each kernel (so their
tolerances and bit-for-bit checks hold for the kernels' arithmetic, and a kernel that
breaks the definition fails them), and the runtime's entry points and MLACache with CuPy
replaced by a stand-in (kernel choice, arguments, geometry, refusals before any launch
or state change).

Random inputs are fresh each run (KGEN_TEST_SEED=<seed> replays one)."""

from __future__ import annotations

import math

import kgen_kernels
import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen import ops
from kgen.ir.axes import IoDtype, Lse, Mask, Op, SeqStarts
from kgen.ir.geometry import (
    MLA_COMBINE_THREADS,
    MLA_HEADS,
    MLA_LATENT,
    MLA_PREFILL_QK,
    MLA_PREFILL_ROWS,
    MLA_PREFILL_V,
    MLA_ROPE,
    MLA_ROW,
    MLA_SPLIT_KEYS,
    MLA_STORE_THREADS,
    MLA_THREADS,
    MLA_TILE,
    mla_decode_shared,
    mla_default_splits,
    mla_gather_threads,
    mla_prefill_shared,
    mla_split_keys,
)
from kgen.runtime import ContractError, bind
from kgen.runtime import mla as rmla
from kgen.runtime.record import registers
from kgen.testing import check_kernel, host_args
from kgen.testing import mla as tmla
from kgen.testing.case import Case
from kgen.testing.fakecupy import FakeArray, FakeCupy, Guarded
from kgen.testing.testgen import plan_cases

F32 = IoDtype.F32
HALF = (IoDtype.BF16, IoDtype.F16)
BUILT = [k for mod in kgen_kernels.MODULES.values() for k in mod.KERNELS.values()
         if k.op in (Op.MLA_STORE, Op.MLA_GATHER, Op.MLA_DECODE, Op.MLA_COMBINE,
                     Op.MLA_PREFILL)]
# The f32 kernels by their option axes; every kernel by (op, in_dtype, out_dtype) too.
KERNELS = {(k.op, k.lse if k.op is Op.MLA_COMBINE else k.seq_starts): k for k in BUILT
           if k.op is not Op.MLA_PREFILL and k.in_dtype is k.out_dtype is F32}
STORE = KERNELS[(Op.MLA_STORE, SeqStarts.NONE)]
GATHER = KERNELS[(Op.MLA_GATHER, SeqStarts.NONE)]
GATHER_STARTS = KERNELS[(Op.MLA_GATHER, SeqStarts.GIVEN)]
DECODE = KERNELS[(Op.MLA_DECODE, SeqStarts.NONE)]
COMBINE = KERNELS[(Op.MLA_COMBINE, Lse.NONE)]
COMBINE_LSE = KERNELS[(Op.MLA_COMBINE, Lse.WRITE)]
PREFILLS = {(k.mask, k.lse): k for k in BUILT
            if k.op is Op.MLA_PREFILL and k.in_dtype is k.out_dtype is F32}


def of(op: Op) -> list:
    """Every built kernel of ``op`` (each element type)."""
    return [k for k in BUILT if k.op is op]


# the bf16 kernel of each op, of its plain form (no LSE, no seq_starts, causal; its
# element types all bf16 where the op has them)
BF16 = {k.op: k for k in BUILT
        if (not ops.get(k.op).in_dtype or k.in_dtype is IoDtype.BF16)
        and (not ops.get(k.op).out_dtype or k.out_dtype is IoDtype.BF16)
        and k.lse is Lse.NONE and k.seq_starts is SeqStarts.NONE and k.mask is Mask.CAUSAL}


def test_every_mla_kernel_is_built():
    assert len(KERNELS) == 6
    assert set(PREFILLS) == {(m, lse) for m in (Mask.CAUSAL, Mask.FULL)
                             for lse in (Lse.NONE, Lse.WRITE)}
    # 16-bit rows: the store, gather, split stage of each; the merge stage into each;
    # the prefill into the same type and into f32
    for d in HALF:
        assert sum(k.in_dtype is d for k in of(Op.MLA_STORE)) == 1
        assert sum(k.in_dtype is d for k in of(Op.MLA_GATHER)) == 2
        assert sum(k.in_dtype is d for k in of(Op.MLA_DECODE)) == 1
        assert sum(k.out_dtype is d for k in of(Op.MLA_COMBINE)) == 2
        for fo in (d, F32):
            assert {(k.mask, k.lse) for k in of(Op.MLA_PREFILL)
                    if (k.in_dtype, k.out_dtype) == (d, fo)} == set(PREFILLS)


# ---- the definitions -----------------------------------------------------------------

@pytest.mark.parametrize("seq_len", [1, 15, 16, 17, 100, 1000, 4097])
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16, 64])
def test_split_rule_covers_every_key_once_in_whole_tiles(seq_len, splits):
    kps = mla_split_keys(seq_len, splits)
    assert kps % MLA_TILE == 0 and kps >= MLA_TILE
    bounds = [(s * kps, min(seq_len, (s + 1) * kps)) for s in range(splits)]
    live = [(lo, hi) for lo, hi in bounds if lo < hi]
    assert live == bounds[: len(live)]  # the empty splits are the last ones
    assert sum(hi - lo for lo, hi in live) == seq_len and live[0][0] == 0


def test_default_split_count_is_the_engines_rule():
    # min(next_pow2(max(1, max_seq_len / 512)), 2 * SMs)
    assert [mla_default_splits(n, 13) for n in (1, 511, 512, 1024, 1536, 2048, 5000)] == \
        [1, 1, 1, 2, 4, 4, 16]
    assert mla_default_splits(10**6, 13) == 26 and mla_default_splits(10**6, 132) == 264
    assert mla_default_splits(MLA_SPLIT_KEYS * 3, 100) == 4


def _pages(g, nb, bs):
    return g.standard_normal((nb, bs, MLA_ROW)).astype(np.float32)


def test_partials_merged_are_the_direct_decode(rng):
    g, seed = rng
    case = Case("r", requests=((1, 1), (1, 77), (1, 300)), n_head=5, block_size=16)
    lay = tmla.layout(case, g)
    pages = _pages(g, lay["num_blocks"], 16)
    q = g.standard_normal((3, 5, MLA_ROW)).astype(np.float32)
    want, want_lse = ref.mla_decode(q, pages, lay["block_table"], lay["seq_lens"], 0.05,
                                    MLA_LATENT)
    for splits in (1, 2, 5, 30):
        m, l_, acc, live = ref.mla_decode_partials(q, pages, lay["block_table"],
                                                   lay["seq_lens"], 0.05, MLA_LATENT, splits,
                                                   mla_split_keys)
        out, lse = ref.mla_merge(m, l_, acc, live)
        np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12, err_msg=f"seed={seed}")
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, err_msg=f"seed={seed}")


def test_decode_by_hand():
    pages = np.zeros((1, 2, MLA_ROW))
    pages[0, 0, 0], pages[0, 1, 0] = 1.0, 2.0  # v = e0, 2 e0; k the same rows
    q = np.zeros((1, 1, MLA_ROW))
    q[0, 0, 0] = math.log(3.0)  # scores log 3 and 2 log 3 (scale 1): weights 1/4, 3/4
    out, lse = ref.mla_decode(q, pages, np.array([[0]]), np.array([2]), 1.0, MLA_LATENT)
    np.testing.assert_allclose(out[0, 0, 0], 0.25 * 1 + 0.75 * 2)
    np.testing.assert_allclose(lse[0, 0], math.log(3 + 9))


def test_stored_rows_gather_back(rng):
    g, seed = rng
    bs, nb = 4, 6
    cache = np.zeros((nb, bs, MLA_ROW), np.float32)
    table = np.array([[5, 2, 0], [3, 1, 4]], np.int32)
    kv_c = g.standard_normal((13, MLA_LATENT)).astype(np.float32)
    k_pe = g.standard_normal((13, MLA_ROPE)).astype(np.float32)
    # request 0 holds 9 rows, request 1 holds 4; the last token is padding (-1)
    slots = [int(table[0, p // bs]) * bs + p % bs for p in range(9)] + \
        [int(table[1, p // bs]) * bs + p % bs for p in range(3)] + [-1]
    cache = ref.concat_and_cache_mla(cache, kv_c, k_pe, np.array(slots, np.int64))
    cu = np.array([0, 5, 8], np.int32)  # rows 4..8 of request 0, rows 0..2 of request 1
    t2s = np.array([0] * 5 + [1] * 3, np.int32)
    got = ref.gather_mla_cache(cache, table, cu, t2s, np.array([4, 0], np.int32), 8)
    want = np.concatenate([np.concatenate([kv_c, k_pe], axis=1)[4:9],
                           np.concatenate([kv_c, k_pe], axis=1)[9:12]])
    assert np.array_equal(got, want), f"seed={seed}"


# ---- the GPU checks, over f32 emulations of the kernels ----------------------------------

class HostArray(np.ndarray):
    """A NumPy array with CuPy's ``get``, standing in for a device array."""

    def get(self):
        return np.asarray(self).copy()


@pytest.fixture
def host_device(monkeypatch):
    monkeypatch.setattr(tmla, "dev", lambda x: np.array(x).view(HostArray))
    monkeypatch.setattr(tmla, "poisoned", lambda shape: np.full(shape, np.nan, np.float32)
                        .view(HostArray))
    monkeypatch.setattr(tmla, "poisoned_as", lambda shape, fmt: np.full(
        shape, fmt.poison(), np.dtype(fmt.dtype)).view(HostArray))


def _widen(k, x):
    """The f32 values a kernel computes with from its in_dtype elements."""
    return k.in_dtype.fmt.dequantize_rows(np.asarray(x))


def _store(fault=None):
    def fn(kv_c, k_pe, cache, slots, stream=None):
        nb, bs, _ = cache.shape
        for t, s in enumerate(np.asarray(slots)):
            if s < 0 and fault != "negative_slot_kept":
                continue
            src = np.concatenate([kv_c[t], k_pe[t]])
            if fault == "contiguous_rows":  # ignores the row stride: reads rows 512 apart
                item = kv_c.itemsize
                dense = np.lib.stride_tricks.as_strided(kv_c, strides=(MLA_LATENT * item, item))
                src[:MLA_LATENT] = dense[t]
            cache[s // bs, s % bs] = src
    return fn


def _gather(k, fault=None):
    def fn(dst, src, table, cu, t2s, *starts, num_tokens, stream=None):
        bs = src.shape[1]
        for i in range(num_tokens + (1 if fault == "past_n" else 0)):
            r = int(t2s[min(i, len(t2s) - 1)])
            j = (int(starts[0][r]) if starts and fault != "starts_ignored" else 0) + i - int(cu[r])
            dst[i] = src[table[r, j // bs], j % bs]
    return fn


def _decode(k, fault=None):
    def fn(q, pages, table, lens, m, l_, acc, scale, stream=None):
        B, H, S = m.shape
        q32 = _widen(k, q) if fault != "raw_elements" else np.asarray(q, np.float32)
        pages = _widen(k, pages) if fault != "raw_elements" else np.asarray(pages, np.float32)
        for b in range(B):
            n = int(lens[b])
            kps = mla_split_keys(n, S)
            rows = ref.mla.request_rows(pages, np.asarray(table)[b], 0, n)
            for s in range(S):
                lo, hi = s * kps, min(n, (s + 1) * kps)
                if lo >= hi and fault != "empty_written":
                    continue
                if fault == "last_key_dropped":
                    hi = max(lo + 1, hi - 1)
                kv = rows[lo:hi]
                qk = (q32[b] @ kv.T) * np.float32(scale)
                mx = qk.max(axis=1) if kv.size else np.full(H, -np.inf, np.float32)
                e = np.exp(qk - mx[:, None]) if kv.size else np.zeros((H, 0), np.float32)
                m[b, :, s], l_[b, :, s] = mx, e.sum(axis=1)
                acc[b, :, s] = e @ kv[:, :MLA_LATENT] if kv.size else 0.0
    return fn


def _combine(k, fault=None):
    fo = k.out_dtype.fmt

    def fn(m, l_, acc, lens, out, *lse, stream=None):
        B, H, S = m.shape
        for b in range(B):
            n = int(lens[b])
            kps = mla_split_keys(n, S)
            live = S if fault == "dead_read" else min(S, -(-n // kps))
            mm = np.asarray(m[b, :, :live], np.float32)
            with np.errstate(invalid="ignore"):
                M = np.max(mm, axis=1)
            ok = ~np.isneginf(M)
            w = np.exp(mm - np.where(ok, M, 0)[:, None]).astype(np.float32)
            L = (l_[b, :, :live] * w).sum(axis=1)
            o = (acc[b, :, :live] * w[:, :, None]).sum(axis=1)
            with np.errstate(invalid="ignore", divide="ignore"):
                out[b] = fo.quantize_rows(np.where(ok[:, None], o / L[:, None], 0.0))
                if lse:
                    lse[0][b] = np.where(ok, M + np.log(L), -np.inf)
    return fn


def _prefill(k, fault=None):
    causal = k.mask is Mask.CAUSAL
    fo = k.out_dtype.fmt

    def fn(q, key, value, cu_q, cu_k, out, *lse, max_seqlen_q, scale, stream=None):
        q, key, value = _widen(k, q), _widen(k, key), _widen(k, value)
        for r in range(len(cu_q) - 1):
            q0, q1, k0, k1 = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
            Lq, Lk = q1 - q0, k1 - k0
            for i in range(Lq):
                shift = 0 if fault == "top_left" else Lk - Lq
                n = min(Lk, i + shift + 1) if causal else Lk
                if n <= 0:
                    out[q0 + i] = np.nan if fault == "nan_empty" else 0.0
                    if lse:
                        lse[0][:, q0 + i] = -np.inf
                    continue
                s_ = np.einsum("hd,jhd->hj", q[q0 + i], key[k0:k0 + n]).astype(np.float32)
                s_ *= np.float32(scale)
                m = s_.max(axis=1, keepdims=True)
                e = np.exp(s_ - m)
                tot = e.sum(axis=1, keepdims=True)
                out[q0 + i] = fo.quantize_rows(np.einsum("hj,jhd->hd", e / tot,
                                                         value[k0:k0 + n]))
                if lse:
                    lse[0][:, q0 + i] = (m + np.log(tot))[:, 0]
    return fn


def _cases(k):
    return [pytest.param(c, id=str(c)) for c in plan_cases(k)[0]]


@pytest.mark.parametrize("k", of(Op.MLA_STORE), ids=lambda k: k.name)
@pytest.mark.parametrize("case", _cases(STORE))
def test_store_check_passes_the_kernels_arithmetic(host_device, k, case):
    check_kernel(k, _store(), case)


@pytest.mark.parametrize("k", of(Op.MLA_GATHER), ids=lambda k: k.name)
def test_gather_check_passes_the_kernels_arithmetic(host_device, k):
    for case in plan_cases(k)[0]:
        check_kernel(k, _gather(k), case)


@pytest.mark.parametrize("k", of(Op.MLA_DECODE), ids=lambda k: k.name)
@pytest.mark.parametrize("case", _cases(DECODE))
def test_decode_check_passes_the_kernels_arithmetic(host_device, k, case):
    check_kernel(k, _decode(k), case)


@pytest.mark.parametrize("k", of(Op.MLA_COMBINE), ids=lambda k: k.name)
def test_combine_check_passes_the_kernels_arithmetic(host_device, k):
    for case in plan_cases(k)[0]:
        check_kernel(k, _combine(k), case)


@pytest.mark.parametrize("k, fn, case", [
    (STORE, _store("negative_slot_kept"), tmla.STORE[4]),
    (STORE, _store("contiguous_rows"), tmla.STORE[1]),
    (GATHER, _gather(GATHER, "past_n"), tmla.GATHER[2]),
    (GATHER_STARTS, _gather(GATHER_STARTS, "starts_ignored"), tmla.GATHER_STARTS[0]),
    (DECODE, _decode(DECODE, "empty_written"), tmla.DECODE[7]),
    (DECODE, _decode(DECODE, "last_key_dropped"), tmla.DECODE[1]),
    (COMBINE, _combine(COMBINE, "dead_read"), tmla.DECODE[7]),
    (BF16[Op.MLA_DECODE], _decode(BF16[Op.MLA_DECODE], "raw_elements"), tmla.DECODE[1]),
    (BF16[Op.MLA_STORE], _store("contiguous_rows"), tmla.STORE[1]),
    (BF16[Op.MLA_COMBINE], _combine(BF16[Op.MLA_COMBINE], "dead_read"), tmla.DECODE[7]),
], ids=["store_negative", "store_stride", "gather_past_n", "gather_starts", "decode_empty",
        "decode_key_dropped", "combine_dead_split", "bf16_decode_not_widened",
        "bf16_store_stride", "bf16_combine_dead_split"])
def test_the_gpu_checks_fail_a_kernel_that_breaks_the_definition(host_device, k, fn, case):
    with pytest.raises(AssertionError):
        check_kernel(k, fn, case)


@pytest.mark.parametrize("k", of(Op.MLA_PREFILL), ids=lambda k: k.name)
def test_prefill_check_passes_the_kernels_arithmetic(host_device, k):
    for case in plan_cases(k)[0]:
        if case.n_head * sum(q for q, _ in case.requests) > 2000:
            continue  # the emulation is slow; the GPU runs the large ones
        check_kernel(k, _prefill(k), case)


@pytest.mark.parametrize("fault", ["top_left", "nan_empty"])
def test_the_prefill_check_fails_a_kernel_that_breaks_the_definition(host_device, fault):
    k = PREFILLS[(Mask.CAUSAL, Lse.WRITE)]
    with pytest.raises(AssertionError):
        check_kernel(k, _prefill(k, fault), tmla.PREFILL[3] if fault == "nan_empty"
                     else tmla.PREFILL[1])


def test_prefill_reference_causal_is_bottom_right():
    g = np.random.default_rng(1)
    q = g.standard_normal((2, 1, 4))
    k = g.standard_normal((5, 1, 4))
    v = g.standard_normal((5, 1, 3))
    cu_q, cu_k = np.array([0, 2]), np.array([0, 5])
    out, lse = ref.mla_prefill(q, k, v, cu_q, cu_k, 0.5, True)
    full, _ = ref.mla_prefill(q[1:], k, v, np.array([0, 1]), cu_k, 0.5, True)
    np.testing.assert_allclose(out[1], full[0])  # the last query sees every key
    first, _ = ref.mla_prefill(q[:1], k[:4], v[:4], np.array([0, 1]), np.array([0, 4]), 0.5,
                               False)
    np.testing.assert_allclose(out[0], first[0])  # query 0 of 2 sees keys 0..3


def test_the_gpu_cases_cover_the_engines_shapes():
    decode = plan_cases(DECODE)[0]
    assert {16, 128} <= {c.n_head for c in decode}
    assert any(c.n_head % MLA_HEADS for c in decode)  # a partial head group
    assert 1 in {c.n_splits for c in decode}
    assert any(mla_split_keys(n, c.n_splits) * (c.n_splits - 1) >= n
               for c in decode for _, n in c.requests)  # empty splits
    assert any(c.row_pad % 4 for c in plan_cases(STORE)[0])  # rows not float4-aligned
    assert any(c.slots and c.slots < c.n for c in plan_cases(STORE)[0])  # S < T


# ---- bind: geometry and contracts --------------------------------------------------------

def test_bind_geometry():
    case = tmla.DECODE[3]  # 2 requests, 128 heads, 3 splits
    b = bind(DECODE, host_args(DECODE, case))
    assert b.grid == (128 // MLA_HEADS, 3, 2) and b.block == (MLA_THREADS, 1, 1)
    assert b.shared_bytes == 0 and int(b.arg("kv_splits")) == 3
    assert math.isclose(float(b.arg("scale")), 1 / math.sqrt(MLA_ROW), rel_tol=1e-6)
    b = bind(COMBINE_LSE, host_args(COMBINE_LSE, case))
    assert b.grid == (2 * 128, 1, 1) and b.block == (MLA_COMBINE_THREADS, 1, 1)
    b = bind(STORE, host_args(STORE, tmla.STORE[2]))
    assert b.grid == (64, 1, 1) and b.block == (MLA_STORE_THREADS, 1, 1)
    b = bind(GATHER, host_args(GATHER, tmla.GATHER[1]))
    assert b.grid == (-(-82 // (mla_gather_threads() // 32)), 1, 1)


def test_decode_fits_sm37():
    regs = registers(DECODE)
    assert regs is not None and regs <= 255
    assert mla_decode_shared() <= 48 * 1024
    assert mla_prefill_shared() <= 48 * 1024


def test_prefill_bind_geometry():
    k = PREFILLS[(Mask.CAUSAL, Lse.WRITE)]
    case = tmla.PREFILL[4]  # (100, 300), (64, 64); 8 heads
    a = host_args(k, case)
    b = bind(k, a)
    assert b.grid == (-(-100 // MLA_PREFILL_ROWS), 8, 2)
    assert b.block == (MLA_PREFILL_ROWS * 32, 1, 1) and int(b.arg("total_q")) == 164
    a["lse"] = np.zeros((164, 8), np.float32)
    with pytest.raises(ContractError) as e:
        bind(k, a)
    assert e.value.contract == "lse layout"


def test_prefill_entry_point(cp):
    Tq, Tk, H = 9, 20, 4
    args = (cp.empty((Tq, H, MLA_PREFILL_V)), cp.empty((H, Tq)),
            cp.empty((Tq, H, MLA_PREFILL_QK)), cp.empty((Tk, H, MLA_PREFILL_QK)),
            cp.empty((Tk, H, MLA_PREFILL_V)), _upload(cp, np.array([0, 4, 9], np.int32)),
            _upload(cp, np.array([0, 10, 20], np.int32)))
    for causal, with_lse in ((True, True), (False, False)):
        out, lse, *rest = args
        b = rmla.mla_prefill_attention(out, lse if with_lse else None, *rest, 0.07, causal, 5,
                                       max_seqlen_k=10)
        assert b.kernel == PREFILLS[(Mask.CAUSAL if causal else Mask.FULL,
                                     Lse.WRITE if with_lse else Lse.NONE)].name
    n = lambda: len(cp.launched)  # noqa: E731
    cp.refuses(n, "above max_seqlen_q", rmla.mla_prefill_attention, *args, 0.07, True, 4)
    cp.refuses(n, "causal must be", rmla.mla_prefill_attention, *args, 0.07, 1, 5)
    cp.refuses(n, "max_seqlen_k", rmla.mla_prefill_attention, *args, 0.07, True, 5,
               max_seqlen_k=0)


def test_store_takes_strided_rows():
    a = host_args(STORE, tmla.STORE[1])
    wide = np.zeros((37, MLA_LATENT + 40), np.float32)
    a["kv_c"] = wide[:, :MLA_LATENT]
    a["k_pe"] = np.zeros((37, MLA_ROPE + 3), np.float32)[:, 3:]
    b = bind(STORE, a)
    assert int(b.arg("kv_c_stride")) == MLA_LATENT + 40
    assert int(b.arg("k_pe_stride")) == MLA_ROPE + 3


# ---- the entry points and MLACache, with CuPy a stand-in ---------------------------------

@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(rmla, "_CHOSEN", {})
    return Guarded().install(monkeypatch)


def _upload(cp, x):
    return cp.asarray(np.asarray(x))


def test_store_entry_point(cp):
    kv_c = FakeArray((5, MLA_LATENT), np.float32, strides=((MLA_LATENT + 8) * 4, 4))
    k_pe, cache = cp.empty((5, MLA_ROPE)), cp.empty((3, 4, MLA_ROW))
    b = rmla.concat_and_cache_mla(kv_c, k_pe, cache,
                                  _upload(cp, np.array([0, -1, 7, 3], np.int64)))
    name, grid, block, args, _, _ = cp.launched[-1]
    assert name == STORE.name and grid == (4, 1, 1)
    assert int(b.arg("kv_c_stride")) == MLA_LATENT + 8 and int(b.arg("n_slots")) == 4
    cp.refuses(lambda: len(cp.launched), "slot beyond", rmla.concat_and_cache_mla, kv_c, k_pe,
               cache, _upload(cp, np.array([12], np.int64)))
    cp.refuses(lambda: len(cp.launched), "int64", rmla.concat_and_cache_mla, kv_c, k_pe,
               cache, _upload(cp, np.array([1], np.int32)))


def _decode_args(cp, B=2, H=16, bs=16, lens=(40, 3)):
    table = np.arange(B * 4, dtype=np.int32).reshape(B, 4)
    return (cp.empty((B, H, MLA_LATENT)), cp.empty((B, H)), cp.empty((B, H, MLA_ROW)),
            cp.empty((B * 4, bs, MLA_ROW)), _upload(cp, table),
            _upload(cp, np.array(lens, np.int32)))


@pytest.mark.parametrize("with_lse", [False, True])
def test_decode_entry_point_launches_both_stages(cp, with_lse):
    out, lse, q, cache, table, lens = _decode_args(cp)
    rmla.mla_decode_attention(out, lse if with_lse else None, q, cache, table, lens, 0.1,
                              num_kv_splits=3)
    (n1, g1, b1, a1, _, _), (n2, g2, b2, a2, _, _) = cp.launched
    assert n1 == DECODE.name and g1 == (1, 3, 2) and b1 == (MLA_THREADS, 1, 1)
    assert n2 == (COMBINE_LSE if with_lse else COMBINE).name and g2 == (2 * 16, 1, 1)
    assert a1[4] is a2[0] and a1[6] is a2[2]  # the partials the first writes, the second reads
    assert a1[4].shape == (2, 16, 3) and a1[6].shape == (2, 16, 3, MLA_LATENT)


def test_decode_entry_point_split_count(cp):
    out, lse, q, cache, table, lens = _decode_args(cp)
    rmla.mla_decode_attention(out, lse, q, cache, table, lens, 0.1, max_seq_len=2048)
    assert cp.launched[0][1][1] == mla_default_splits(2048, 13) == 4
    rmla.mla_decode_attention(out, lse, q, cache, table, lens, 0.1)  # bound: table capacity
    assert cp.launched[2][1][1] == mla_default_splits(4 * 16, 13) == 1
    rmla.mla_decode_attention(out, lse, q, cache, table, lens, 0.1, num_kv_splits=1,
                              max_seq_len=10**6)
    assert cp.launched[4][1][1] == 1


def test_decode_entry_point_refuses_before_anything(cp):
    out, lse, q, cache, table, lens = _decode_args(cp)
    n = lambda: len(cp.launched)  # noqa: E731
    cp.refuses(n, "seq_lens", rmla.mla_decode_attention, out, lse, q, cache, table,
               _upload(cp, np.array([0, 3], np.int32)), 0.1)
    cp.refuses(n, "past its table", rmla.mla_decode_attention, out, lse, q, cache, table,
               _upload(cp, np.array([65, 3], np.int32)), 0.1)
    cp.refuses(n, "out has shape", rmla.mla_decode_attention, cp.empty((2, 16, 64)), lse, q,
               cache, table, lens, 0.1)
    cp.refuses(n, "lse has shape", rmla.mla_decode_attention, out, cp.empty((16, 2)), q,
               cache, table, lens, 0.1)
    cp.refuses(n, "num_kv_splits", rmla.mla_decode_attention, out, lse, q, cache, table, lens,
               0.1, num_kv_splits=-1)
    cp.refuses(n, "scale", rmla.mla_decode_attention, out, lse, q, cache, table, lens, 0.0)
    cp.refuses(n, "validate must be", rmla.mla_decode_attention, out, lse, q, cache, table,
               lens, 0.1, validate=1)


def test_float4_arrays_must_be_aligned(cp):
    from kgen.testing.fakecupy import _Ptr

    out, lse, q, cache, table, lens = _decode_args(cp)
    odd = FakeArray(cache.shape, np.float32, data=_Ptr(0, cache.data.ptr + 4))
    cp.refuses(lambda: len(cp.launched), "16-byte boundary", rmla.mla_decode_attention, out,
               lse, q, odd, table, lens, 0.1)
    dst = cp.empty((4, MLA_ROW))
    cu, t2s = _upload(cp, np.array([0, 4], np.int32)), _upload(cp, np.zeros(4, np.int32))
    one = _upload(cp, np.zeros((1, 4), np.int32))
    rmla.gather_mla_cache(dst, cache, one, cu, t2s, None, 4)  # aligned: launches
    shifted = FakeArray(dst.shape, np.float32, data=_Ptr(0, dst.data.ptr + 8))
    with pytest.raises(ContractError) as e:
        rmla.gather_mla_cache(shifted, cache, one, cu, t2s, None, 4)
    assert e.value.contract == "alignment"


def test_gather_entry_point(cp):
    dst, cache = cp.empty((9, MLA_ROW)), cp.empty((4, 16, MLA_ROW))
    table = _upload(cp, np.array([[0, 1], [2, 3]], np.int32))
    cu = _upload(cp, np.array([0, 4, 9], np.int32))
    t2s = _upload(cp, np.array([0] * 4 + [1] * 5, np.int32))
    b = rmla.gather_mla_cache(dst, cache, table, cu, t2s, None, 9)
    assert b.kernel == GATHER.name
    b = rmla.gather_mla_cache(dst, cache, table, cu, t2s,
                                 _upload(cp, np.array([16, 0], np.int32)), 9)
    assert b.kernel == GATHER_STARTS.name
    cp.refuses(lambda: len(cp.launched), "multiples of block_size", rmla.gather_mla_cache,
               dst, cache, table, cu, t2s, _upload(cp, np.array([3, 0], np.int32)), 9)
    cp.refuses(lambda: len(cp.launched), "dst holds", rmla.gather_mla_cache, dst, cache, table,
               cu, t2s, None, 10)


def _state(c):
    return (list(c.free_blocks), {s: list(t) for s, t in c.tables.items()}, dict(c.lengths),
            c._next)


def test_mla_cache_store_then_decode(cp):
    c = rmla.MLACache(num_blocks=8, block_size=4)
    a, b = c.add(), c.add()
    c.store([a, b], cp.empty((7, MLA_LATENT)), cp.empty((7, MLA_ROPE)), [5, 2])
    assert c.lengths == {a: 5, b: 2} and len(c.tables[a]) == 2 and len(c.tables[b]) == 1
    (name, grid, _, args, _, _), = cp.launched
    assert name == STORE.name and grid == (7, 1, 1)
    out, lse = c.decode([a, b], cp.empty((2, 16, MLA_ROW)), cp.empty((2, MLA_LATENT)),
                        cp.empty((2, MLA_ROPE)), scale=0.1, num_kv_splits=2, lse=True)
    assert [x[0] for x in cp.launched[1:]] == [STORE.name, DECODE.name, COMBINE_LSE.name]
    assert out.shape == (2, 16, MLA_LATENT) and lse.shape == (2, 16)
    assert c.lengths == {a: 6, b: 3}
    seq_lens = cp.launched[2][3][3]
    assert list(seq_lens.host) == [6, 3]
    rows = c.gather([a, b], [4, 0])
    assert rows.shape == (2 + 3, MLA_ROW) and cp.launched[-1][0] == GATHER_STARTS.name


def test_mla_cache_refuses_before_any_change(cp):
    c = rmla.MLACache(num_blocks=2, block_size=4)
    a, b = c.add(), c.add()
    st = lambda: _state(c)  # noqa: E731
    cp.refuses(st, "kv_c must be", c.store, [a], cp.empty((3, MLA_LATENT - 1)),
               cp.empty((3, MLA_ROPE)), [3])
    cp.refuses(st, "out of blocks", c.store, [a, b], cp.empty((9, MLA_LATENT)),
               cp.empty((9, MLA_ROPE)), [5, 4])
    cp.refuses(st, "max_blocks_per_seq", c.store, [a], cp.empty((9, MLA_LATENT)),
               cp.empty((9, MLA_ROPE)), [9])
    cp.refuses(st, "no sequence", c.store, [b + 1], cp.empty((1, MLA_LATENT)),
               cp.empty((1, MLA_ROPE)), [1])
    cp.refuses(st, "query must be", c.decode, [a], cp.empty((1, 16, MLA_LATENT)),
               cp.empty((1, MLA_LATENT)), cp.empty((1, MLA_ROPE)))
    cp.refuses(st, "num_kv_splits", c.decode, [a], cp.empty((1, 16, MLA_ROW)),
               cp.empty((1, MLA_LATENT)), cp.empty((1, MLA_ROPE)), num_kv_splits=1.5)
    cp.refuses(st, "nothing to gather", c.gather, [a], [0])  # nothing stored: no rows
    cp.refuses(st, "multiple of block_size", c.gather, [a], [4])
    with pytest.raises(ContractError, match="variants"):
        rmla.MLACache(2, 4, variants={"prefill": "x"})


def test_mla_cache_with_plain_fake(monkeypatch):
    monkeypatch.setattr(rmla, "_CHOSEN", {})
    cp = FakeCupy().install(monkeypatch)
    c = rmla.MLACache(num_blocks=4, block_size=16)
    s = c.add()
    c.store([s], cp.empty((20, MLA_LATENT)), cp.empty((20, MLA_ROPE)), [20])
    out = c.decode([s], cp.empty((1, 128, MLA_ROW)), cp.empty((1, MLA_LATENT)),
                   cp.empty((1, MLA_ROPE)))
    assert out.shape == (1, 128, MLA_LATENT)
    assert cp.launched[-2][1] == (128 // MLA_HEADS, 1, 1)  # 21 keys: the default, one split


# ---- 16-bit element types through the entry points and MLACache --------------------------

def _named(op: Op, fi: IoDtype, fo: IoDtype = F32, **axes) -> str:
    """The name of the kernel of ``op`` with these element types and option axes."""
    ks = [k for k in of(op) if (not ops.get(op).in_dtype or k.in_dtype is fi) and
          (not ops.get(op).out_dtype or k.out_dtype is fo) and
          all(getattr(k, a) is v for a, v in axes.items())]
    assert len(ks) == 1, (op, fi, fo, axes, [k.name for k in ks])
    return ks[0].name


@pytest.mark.parametrize("dtype", HALF)
def test_entry_points_choose_by_element_type(cp, dtype):
    e = np.dtype(dtype.fmt.dtype)
    kv_c = FakeArray((5, MLA_LATENT), e, strides=((MLA_LATENT + 8) * e.itemsize, e.itemsize))
    k_pe, cache = cp.empty((5, MLA_ROPE), e), cp.empty((3, 4, MLA_ROW), e)
    b = rmla.concat_and_cache_mla(kv_c, k_pe, cache, _upload(cp, np.array([0, -1, 7], np.int64)))
    assert b.kernel == _named(Op.MLA_STORE, dtype) and int(b.arg("kv_c_stride")) == MLA_LATENT + 8
    dst = cp.empty((4, MLA_ROW), e)
    cu, t2s = _upload(cp, np.array([0, 4], np.int32)), _upload(cp, np.zeros(4, np.int32))
    b = rmla.gather_mla_cache(dst, cache, _upload(cp, np.zeros((1, 4), np.int32)), cu, t2s,
                              None, 4)
    assert b.kernel == _named(Op.MLA_GATHER, dtype, seq_starts=SeqStarts.NONE)
    out, lse, q, pages, table, lens = _decode_args(cp)
    q, pages = cp.empty(q.shape, e), cp.empty(pages.shape, e)
    for fo in (dtype, F32):
        n = len(cp.launched)
        rmla.mla_decode_attention(cp.empty(out.shape, np.dtype(fo.fmt.dtype)), lse, q, pages,
                                  table, lens, 0.1, num_kv_splits=2)
        assert [x[0] for x in cp.launched[n:]] == [
            _named(Op.MLA_DECODE, dtype), _named(Op.MLA_COMBINE, dtype, fo, lse=Lse.WRITE)]
    Tq, Tk, H = 9, 20, 4
    pargs = (cp.empty((Tq, H, MLA_PREFILL_QK), e), cp.empty((Tk, H, MLA_PREFILL_QK), e),
             cp.empty((Tk, H, MLA_PREFILL_V), e), _upload(cp, np.array([0, 4, 9], np.int32)),
             _upload(cp, np.array([0, 10, 20], np.int32)))
    for fo in (dtype, F32):
        b = rmla.mla_prefill_attention(cp.empty((Tq, H, MLA_PREFILL_V), np.dtype(fo.fmt.dtype)),
                                       cp.empty((H, Tq)), *pargs, 0.07, False, 5)
        assert b.kernel == _named(Op.MLA_PREFILL, dtype, fo, mask=Mask.FULL, lse=Lse.WRITE)
    n = lambda: len(cp.launched)  # noqa: E731
    # one element type for the rows and the cache, for query and the cache, for q, K, V
    cp.refuses(n, "kv_cache must be", rmla.concat_and_cache_mla, kv_c, k_pe,
               cp.empty((3, 4, MLA_ROW)), _upload(cp, np.array([0], np.int64)))
    cp.refuses(n, "query must be", rmla.mla_decode_attention, cp.empty(out.shape, e), lse,
               cp.empty(q.shape), pages, table, lens, 0.1)
    cp.refuses(n, "value must be", rmla.mla_prefill_attention, cp.empty((Tq, H, MLA_PREFILL_V)),
               None, pargs[0], pargs[1], cp.empty((Tk, H, MLA_PREFILL_V)), *pargs[3:], 0.07,
               True, 5)
    cp.refuses(n, "must be one of", rmla.mla_decode_attention, out, lse, q,
               cp.empty(pages.shape, np.float64), table, lens, 0.1)
    # the lse stays float32
    cp.refuses(n, "lse must be float32", rmla.mla_decode_attention, cp.empty(out.shape, e),
               cp.empty((2, 16), e), q, pages, table, lens, 0.1)


@pytest.mark.parametrize("dtype", HALF)
def test_mla_cache_of_16_bit_rows(cp, dtype):
    e = np.dtype(dtype.fmt.dtype)
    c = rmla.MLACache(num_blocks=8, block_size=4, dtype=dtype.value)
    assert c.cache.dtype == e
    a, b = c.add(), c.add()
    c.store([a, b], cp.empty((7, MLA_LATENT), e), cp.empty((7, MLA_ROPE), e), [5, 2])
    assert cp.launched[-1][0] == _named(Op.MLA_STORE, dtype)
    out = c.decode([a, b], cp.empty((2, 16, MLA_ROW), e), cp.empty((2, MLA_LATENT), e),
                   cp.empty((2, MLA_ROPE), e), scale=0.1, num_kv_splits=2)
    assert out.dtype == e and out.shape == (2, 16, MLA_LATENT)
    assert [x[0] for x in cp.launched[-3:]] == [
        _named(Op.MLA_STORE, dtype), _named(Op.MLA_DECODE, dtype),
        _named(Op.MLA_COMBINE, dtype, dtype, lse=Lse.NONE)]
    out, lse = c.decode([a, b], cp.empty((2, 16, MLA_ROW), e), cp.empty((2, MLA_LATENT), e),
                        cp.empty((2, MLA_ROPE), e), lse=True, out_dtype="f32")
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert cp.launched[-1][0] == _named(Op.MLA_COMBINE, dtype, F32, lse=Lse.WRITE)
    assert c.lengths == {a: 7, b: 4}
    rows = c.gather([a, b], [4, 0])
    assert rows.dtype == e and rows.shape == (3 + 4, MLA_ROW)
    assert cp.launched[-1][0] == _named(Op.MLA_GATHER, dtype, seq_starts=SeqStarts.GIVEN)
    st = lambda: _state(c)  # noqa: E731
    cp.refuses(st, "kv_c must be", c.store, [a], cp.empty((1, MLA_LATENT)),
               cp.empty((1, MLA_ROPE), e), [1])
    cp.refuses(st, "query must be", c.decode, [a], cp.empty((1, 16, MLA_ROW)),
               cp.empty((1, MLA_LATENT), e), cp.empty((1, MLA_ROPE), e))
    cp.refuses(st, "dtype must be", c.decode, [a], cp.empty((1, 16, MLA_ROW), e),
               cp.empty((1, MLA_LATENT), e), cp.empty((1, MLA_ROPE), e), out_dtype="f64")
    with pytest.raises(ContractError, match="dtype must be"):
        rmla.MLACache(2, 4, dtype="float64")
