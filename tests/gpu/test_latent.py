"""The multi-head latent attention ops on the GPU, through their entry points
(kgen.runtime.mla): the decode against the float64 definition at the engine's head
counts and split counts (the default rule, one split, more splits than keys), with and
without the LSE; its bits reproducible run to run for a fixed split count, and with one
split independent of the batch a request decodes in; the store from strided sources and
the gather back; MLACache chaining store -> decode -> gather; the prefill (QK 192, V 128)
against the definition, and its context chunks merged by MergeAttnStates."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.ir.geometry import MLA_LATENT, MLA_PREFILL_QK, MLA_PREFILL_V, MLA_ROPE, MLA_ROW
from kgen.testing import rng
from kgen.testing.case import bits_equal

pytestmark = pytest.mark.gpu
RTOL, ATOL = 2e-4, 2e-5
SCALE = 0.1352  # given, as the engine gives it (a YaRN factor folded in)


def _rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def _paged(g, lens, bs):
    """Shuffled pages holding each request's rows, its block table and seq_lens."""
    mb = max(-(-n // bs) for n in lens)
    nb = len(lens) * mb + 2
    phys = g.permutation(nb).astype(np.int32)
    table = phys[: len(lens) * mb].reshape(len(lens), mb).copy()
    return _rand(g, nb, bs, MLA_ROW), table, np.array(lens, np.int32)


def _decode(cp, pages, table, lens, q, splits, with_lse=True, max_seq_len=None):
    from kgen.runtime import mla_decode_attention

    B, H = q.shape[:2]
    out = cp.full((B, H, MLA_LATENT), np.nan, np.float32)
    lse = cp.full((B, H), np.nan, np.float32) if with_lse else None
    mla_decode_attention(out, lse, cp.asarray(q), cp.asarray(pages), cp.asarray(table),
                         cp.asarray(lens), SCALE, num_kv_splits=splits,
                         max_seq_len=max_seq_len)
    cp.cuda.get_current_stream().synchronize()
    return out.get(), None if lse is None else lse.get()


@pytest.mark.parametrize("n_head", [16, 32, 128, 20])
@pytest.mark.parametrize("splits", [0, 1, 5])
def test_decode_against_the_definition(n_head, splits):
    import cupy as cp

    g, seed = rng()
    lens = [1, 700, 2049, 37]
    pages, table, sl = _paged(g, lens, 16)
    q = _rand(g, len(lens), n_head, MLA_ROW)
    out, lse = _decode(cp, pages, table, sl, q, splits, max_seq_len=max(lens))
    want, want_lse = ref.mla_decode(q, pages, table, sl, SCALE, MLA_LATENT)
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")
    np.testing.assert_allclose(lse, want_lse, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")


def test_decode_without_lse_and_more_splits_than_keys():
    import cupy as cp

    g, seed = rng()
    lens = [3, 17, 64]
    pages, table, sl = _paged(g, lens, 64)
    q = _rand(g, 3, 16, MLA_ROW)
    out, _ = _decode(cp, pages, table, sl, q, 40, with_lse=False)
    want, _ = ref.mla_decode(q, pages, table, sl, SCALE, MLA_LATENT)
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_bits_repeat_run_to_run(splits):
    import cupy as cp

    g, seed = rng()
    pages, table, sl = _paged(g, [3000, 5], 16)
    q = _rand(g, 2, 64, MLA_ROW)
    a, la = _decode(cp, pages, table, sl, q, splits)
    b, lb = _decode(cp, pages, table, sl, q, splits)
    assert bits_equal(a, b) and bits_equal(la, lb), f"seed={seed}"


def test_one_split_is_batch_invariant():
    import cupy as cp

    g, seed = rng()
    lens = [900, 45, 1]
    pages, table, sl = _paged(g, lens, 16)
    q = _rand(g, 3, 16, MLA_ROW)
    batch, batch_lse = _decode(cp, pages, table, sl, q, 1)
    for r in range(3):
        alone, alone_lse = _decode(cp, pages, table[r:r + 1], sl[r:r + 1], q[r:r + 1], 1)
        assert bits_equal(alone[0], batch[r]) and bits_equal(alone_lse[0], batch_lse[r]), \
            f"request {r} differs alone and in a batch, seed={seed}"


def test_store_from_strided_sources_then_gather():
    import cupy as cp

    from kgen.runtime import concat_and_cache_mla, gather_mla_cache

    g, seed = rng()
    T, bs, nb = 50, 16, 8
    old = _rand(g, nb, bs, MLA_ROW)
    wide_c, wide_pe = _rand(g, T, MLA_LATENT + 13), _rand(g, T, MLA_ROPE + 7)
    slots = g.permutation(nb * bs)[:T - 4].astype(np.int64)  # S < T: the tail is padding
    slots[::9] = -1
    cache = cp.asarray(old)
    concat_and_cache_mla(cp.asarray(wide_c)[:, :MLA_LATENT], cp.asarray(wide_pe)[:, 7:],
                         cache, cp.asarray(slots))
    want = ref.concat_and_cache_mla(old, wide_c[:, :MLA_LATENT], wide_pe[:, 7:], slots)
    assert bits_equal(cache.get(), want), f"seed={seed}"
    table = np.array([[3, 1, 4], [0, 2, 5]], np.int32)
    cu = np.array([0, 20, 36], np.int32)
    t2s = np.repeat(np.array([0, 1], np.int32), [20, 16])
    starts = np.array([16, 0], np.int32)
    dst = cp.full((36, MLA_ROW), np.nan, np.float32)
    gather_mla_cache(dst, cache, cp.asarray(table), cp.asarray(cu), cp.asarray(t2s),
                     cp.asarray(starts), 36)
    assert bits_equal(dst.get(), ref.gather_mla_cache(want, table, cu, t2s, starts, 36)), \
        f"seed={seed}"


def test_mla_cache_store_decode_gather():
    import cupy as cp

    from kgen.runtime import MLACache

    g, seed = rng()
    c = MLACache(num_blocks=64, block_size=16, max_blocks_per_seq=16)
    sids = [c.add() for _ in range(3)]
    prompt = [100, 1, 33]
    rows = {s: [] for s in sids}
    kv_c, k_pe = _rand(g, sum(prompt), MLA_LATENT), _rand(g, sum(prompt), MLA_ROPE)
    c.store(sids, cp.asarray(kv_c), cp.asarray(k_pe), prompt)
    at = 0
    for s, n in zip(sids, prompt, strict=True):
        rows[s].append(np.concatenate([kv_c[at:at + n], k_pe[at:at + n]], axis=1))
        at += n
    for step in range(3):
        q = _rand(g, 3, 32, MLA_ROW)
        nc, npe = _rand(g, 3, MLA_LATENT), _rand(g, 3, MLA_ROPE)
        out, lse = c.decode(sids, cp.asarray(q), cp.asarray(nc), cp.asarray(npe), SCALE,
                            num_kv_splits=step + 1, lse=True)
        out, lse = out.get(), lse.get()
        for i, s in enumerate(sids):
            rows[s].append(np.concatenate([nc[i:i + 1], npe[i:i + 1]], axis=1))
            kv = np.concatenate(rows[s])
            qk = SCALE * (q[i].astype(np.float64) @ kv.T.astype(np.float64))
            m = qk.max(axis=1, keepdims=True)
            e = np.exp(qk - m)
            want = (e / e.sum(axis=1, keepdims=True)) @ kv[:, :MLA_LATENT]
            np.testing.assert_allclose(out[i], want, rtol=RTOL, atol=ATOL,
                                       err_msg=f"step {step} seq {s}, seed={seed}")
            np.testing.assert_allclose(lse[i], (m + np.log(e.sum(axis=1, keepdims=True)))[:, 0],
                                       rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")
    got = c.gather(sids, [16, 0, 32]).get()
    want = np.concatenate([np.concatenate(rows[sids[0]])[16:], np.concatenate(rows[sids[1]]),
                           np.concatenate(rows[sids[2]])[32:]])
    assert bits_equal(got, want), f"seed={seed}"
    assert math.isfinite(float(np.abs(got).sum()))


def _prefill(cp, q, k, v, cu_q, cu_k, causal, with_lse=True):
    from kgen.runtime import mla_prefill_attention

    Tq, H = q.shape[:2]
    out = cp.full((Tq, H, MLA_PREFILL_V), np.nan, np.float32)
    lse = cp.full((H, Tq), np.nan, np.float32) if with_lse else None
    mla_prefill_attention(out, lse, cp.asarray(q), cp.asarray(k), cp.asarray(v),
                          cp.asarray(cu_q), cp.asarray(cu_k), SCALE, causal,
                          int(np.diff(cu_q).max()), int(np.diff(cu_k).max()))
    return out, lse


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_head", [16, 128])
def test_prefill_against_the_definition(causal, n_head):
    import cupy as cp

    g, seed = rng()
    lens = [(1, 1), (300, 300), (17, 530), (64, 20)]  # a chunk on a context; rows > keys
    cu_q = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    q = _rand(g, int(cu_q[-1]), n_head, MLA_PREFILL_QK)
    k = _rand(g, int(cu_k[-1]), n_head, MLA_PREFILL_QK)
    v = _rand(g, int(cu_k[-1]), n_head, MLA_PREFILL_V)
    out, lse = _prefill(cp, q, k, v, cu_q, cu_k, causal)
    want, want_lse = ref.mla_prefill(q, k, v, cu_q, cu_k, SCALE, causal)
    np.testing.assert_allclose(out.get(), want, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")
    got_lse = lse.get()
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[seen], want_lse[seen], rtol=RTOL, atol=ATOL,
                               err_msg=f"seed={seed}")
    assert bool(np.isneginf(got_lse[~seen]).all()), f"seed={seed}"


def test_prefill_context_chunks_merge_to_the_whole():
    """The engine's chunked MLA prefill: the new tokens attend causally to themselves and,
    non-causally, to each context chunk; MergeAttnStates folds the chunks in by their
    LSEs ([H, T], the layout both ops share)."""
    import cupy as cp

    from kgen.runtime import merge_attn_states

    g, seed = rng()
    H, T, C = 16, 40, 200  # T new tokens after C context tokens, context in two chunks
    q = _rand(g, T, H, MLA_PREFILL_QK)
    k = _rand(g, C + T, H, MLA_PREFILL_QK)
    v = _rand(g, C + T, H, MLA_PREFILL_V)
    cu_q = np.array([0, T], np.int32)
    acc, acc_lse = _prefill(cp, q, k[C:], v[C:], cu_q, np.array([0, T], np.int32), True)
    for lo, hi in ((0, 120), (120, C)):
        part, part_lse = _prefill(cp, q, k[lo:hi], v[lo:hi], cu_q,
                                  np.array([0, hi - lo], np.int32), False)
        out = cp.empty_like(acc)
        out_lse = cp.empty_like(acc_lse)
        merge_attn_states(out, part, part_lse, acc, acc_lse, out_lse)
        acc, acc_lse = out, out_lse
    want, want_lse = ref.mla_prefill(q, k, v, cu_q, np.array([0, C + T], np.int32), SCALE,
                                     True)
    np.testing.assert_allclose(acc.get(), want, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")
    np.testing.assert_allclose(acc_lse.get(), want_lse, rtol=RTOL, atol=ATOL,
                               err_msg=f"seed={seed}")


# ---- 16-bit latent rows (bf16: uint16 bit patterns, f16: float16) ------------------------
# Inputs are random float32 values rounded by the format's NumPy model; the references
# read the values the kernels hold (exact widening) in float64; a 16-bit output is allowed
# its rounding (the format's error model) on top of the f32 tolerance, and a result
# computed from rounded intermediates the rounding of each of them too.

HALF = ["bf16", "f16"]


def _fmt(name):
    from kgen.ir.axes import IoDtype

    return IoDtype(name).fmt


def _elems(g, fmt, *shape):
    return fmt.quantize_rows(_rand(g, *shape))


def _close_as(fmt, got, want, seed, also=(), what="out"):
    """``got`` (elements of ``fmt``) within the f32 tolerance of float64 ``want`` plus
    the format's rounding of ``want`` and of each intermediate in ``also``."""
    got = fmt.dequantize_rows(np.asarray(got)).astype(np.float64)
    bound = ATOL + RTOL * np.abs(want)
    for x in (want, *also):
        bound = bound + 1.01 * fmt.round_trip_bound(np.asarray(x, np.float64), None)[1]
    err = np.abs(got - want)
    assert not np.isnan(got).any(), f"{what}: NaN left, seed={seed}"
    bad = int(np.count_nonzero(~(err <= bound)))
    assert bad == 0, (f"{what}: {bad} of {got.size} elements past the bound (worst "
                      f"{float(np.max(err - bound)):.3g}), seed={seed}")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n_head, bs", [(16, 16), (128, 64), (16, 64), (128, 16)])
@pytest.mark.parametrize("out_f32", [False, True])
def test_decode_16bit_against_the_definition(dtype, n_head, bs, out_f32):
    import cupy as cp

    from kgen.runtime import mla_decode_attention

    g, seed = rng()
    fmt = _fmt(dtype)
    lens = [1, 700, 2049, 37]
    mb = max(-(-n // bs) for n in lens)
    nb = len(lens) * mb + 2
    table = g.permutation(nb).astype(np.int32)[: len(lens) * mb].reshape(len(lens), mb)
    pages, q = _elems(g, fmt, nb, bs, MLA_ROW), _elems(g, fmt, len(lens), n_head, MLA_ROW)
    sl = np.array(lens, np.int32)
    e_out = np.dtype(np.float32) if out_f32 else np.dtype(fmt.dtype)
    out = cp.empty((len(lens), n_head, MLA_LATENT), e_out)
    out.fill(np.nan if out_f32 else fmt.poison())
    lse = cp.full((len(lens), n_head), np.nan, np.float32)
    mla_decode_attention(out, lse, cp.asarray(q), cp.asarray(pages), cp.asarray(table),
                         cp.asarray(sl), SCALE, max_seq_len=max(lens))
    want, want_lse = ref.mla_decode(fmt.dequantize_rows(q), fmt.dequantize_rows(pages), table,
                                    sl, SCALE, MLA_LATENT)
    _close_as(_fmt("f32") if out_f32 else fmt, out.get(), want, seed)
    np.testing.assert_allclose(lse.get(), want_lse, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n_head, bs", [(16, 16), (128, 64)])
def test_mla_cache_16bit_store_decode_gather_prefill_merge(dtype, n_head, bs):
    """MLACache of 16-bit rows end to end: prompts stored, decode steps (each stores its
    token and attends), the context gathered back bit for bit; then the engine's chunked
    prefill over it, in the same element type: K and V cut from the gathered rows (a
    stand-in for the model's up-projection, bits kept), the context in two non-causal
    chunks and the new tokens causal, each with its LSE, merged by MergeAttnStates."""
    import cupy as cp

    from kgen.runtime import MLACache, merge_attn_states

    g, seed = rng()
    fmt = _fmt(dtype)
    e = np.dtype(fmt.dtype)
    w = fmt.dequantize_rows
    c = MLACache(num_blocks=64, block_size=bs, max_blocks_per_seq=64 // bs * 16, dtype=dtype)
    sids = [c.add() for _ in range(2)]
    prompt = [150, 33]
    kv_c, k_pe = _elems(g, fmt, sum(prompt), MLA_LATENT), _elems(g, fmt, sum(prompt), MLA_ROPE)
    c.store(sids, cp.asarray(kv_c), cp.asarray(k_pe), prompt)
    rows, at = {}, 0
    for s, n in zip(sids, prompt, strict=True):
        rows[s] = [np.concatenate([kv_c[at:at + n], k_pe[at:at + n]], axis=1)]
        at += n
    for step in range(2):
        q = _elems(g, fmt, 2, n_head, MLA_ROW)
        nc, npe = _elems(g, fmt, 2, MLA_LATENT), _elems(g, fmt, 2, MLA_ROPE)
        out, lse = c.decode(sids, cp.asarray(q), cp.asarray(nc), cp.asarray(npe), SCALE,
                            num_kv_splits=step + 1, lse=True)
        assert out.dtype == e and lse.dtype == np.float32
        for i, s in enumerate(sids):
            rows[s].append(np.concatenate([nc[i:i + 1], npe[i:i + 1]], axis=1))
            kv = w(np.concatenate(rows[s])).astype(np.float64)
            qk = SCALE * (w(q[i]).astype(np.float64) @ kv.T)
            m = qk.max(axis=1, keepdims=True)
            ex = np.exp(qk - m)
            want = (ex / ex.sum(axis=1, keepdims=True)) @ kv[:, :MLA_LATENT]
            _close_as(fmt, out.get()[i], want, seed, what=f"decode step {step} seq {s}")
            np.testing.assert_allclose(lse.get()[i], (m + np.log(ex.sum(axis=1,
                                                                        keepdims=True)))[:, 0],
                                       rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")
    ctx = c.gather([sids[0]])
    assert ctx.dtype == e
    assert bits_equal(ctx.get(), np.concatenate(rows[sids[0]])), f"seed={seed}"
    # the prefill: K [C][H][192] and V [C][H][128] cut from the gathered rows, head h from
    # column 3 h on (bits kept); T new tokens after the C context rows
    C, T, H = int(ctx.shape[0]), 24, n_head
    ws = ctx.get()
    cols = (3 * np.arange(H))[:, None] + np.arange(MLA_PREFILL_QK)[None, :]
    k_ctx = ws[:, cols % MLA_ROW]
    v_ctx = ws[:, cols[:, :MLA_PREFILL_V] % MLA_LATENT]
    k_new, v_new = _elems(g, fmt, T, H, MLA_PREFILL_QK), _elems(g, fmt, T, H, MLA_PREFILL_V)
    q = _elems(g, fmt, T, H, MLA_PREFILL_QK)
    cu_q = np.array([0, T], np.int32)

    def prefill(k, v, causal):
        from kgen.runtime import mla_prefill_attention

        o = cp.empty((T, H, MLA_PREFILL_V), e)
        o.fill(fmt.poison())
        ls = cp.full((H, T), np.nan, np.float32)
        n = int(k.shape[0])
        mla_prefill_attention(o, ls, cp.asarray(q), cp.asarray(np.ascontiguousarray(k)),
                              cp.asarray(np.ascontiguousarray(v)), cp.asarray(cu_q),
                              cp.asarray(np.array([0, n], np.int32)), SCALE, causal, T, n)
        want = ref.mla_prefill(w(q), w(k), w(v), cu_q, np.array([0, n]), SCALE, causal)
        return o, ls, want

    acc, acc_lse, (acc_want, _) = prefill(k_new, v_new, True)
    parts = [acc_want]
    cut = C // 2
    for lo, hi in ((0, cut), (cut, C)):
        part, part_lse, (part_want, _) = prefill(k_ctx[lo:hi], v_ctx[lo:hi], False)
        parts.append(part_want)
        out = cp.empty_like(acc)
        out_lse = cp.empty_like(acc_lse)
        merge_attn_states(out, part, part_lse, acc, acc_lse, out_lse)
        acc, acc_lse = out, out_lse
    def over(hi):  # attention over context rows [0, hi) then the new tokens, causal
        key, val = np.concatenate([k_ctx[:hi], k_new]), np.concatenate([v_ctx[:hi], v_new])
        return ref.mla_prefill(w(q), w(key), w(val), cu_q, np.array([0, hi + T]), SCALE,
                               True)

    want, want_lse = over(C)
    # each merge mixes its rounded inputs convexly and rounds: the bound sums the rounding
    # of every part, of the first merge's result (context rows [0, cut) and the new
    # tokens) and of the last (want's)
    _close_as(fmt, acc.get(), want, seed, also=(*parts, over(cut)[0]), what="merged prefill")
    np.testing.assert_allclose(acc_lse.get(), want_lse, rtol=RTOL, atol=ATOL,
                               err_msg=f"seed={seed}")
