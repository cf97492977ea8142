"""The multi-head latent attention kernels' tests: their cases, the layouts of their
arguments on the host (contracts; each op builds its own: kgen.ops) and their GPU checks
against the NumPy definitions (kgen.numpy_ref.mla; each op names its own).

* concat_and_cache_mla: random old pages, random slots over them (some negative:
  skipped), sources strided by ``Case.row_pad``; the pages must equal the reference
  bit for bit (rows nobody stores keep their old bytes).
* gather_mla_cache: requests ``Case.requests`` = (rows gathered, context rows), their
  blocks shuffled over the pages, from ``Case.seq_starts``; the workspace rows must be
  the cache rows bit for bit, and rows past num_tokens stay untouched (NaN).
* mla_decode (split stage): each live split's m, l and acc against the float64
  definition; splits with no keys stay unwritten (NaN).
* mla_combine (merge stage): random partials with NaN in every split that holds no
  keys (the kernel must skip them), some live splits fully masked (m = -inf, l = 0);
  out and lse against the float64 merge.
* mla_prefill: requests ``Case.requests`` = (query rows, keys), q/k/v random; out and
  lse against the float64 varlen attention (causal bottom-right or full, by the mask);
  rows that see no key must be zeros with an LSE of -inf.

Element types (in_dtype, out_dtype; kgen.ir.axes.IoDtype): inputs are random float32
values rounded to the kernel's in_dtype by its format's NumPy model, and the references
read the values the kernel holds (the format's widening, exact); the store and the
gather compare the elements bit for bit; an output of a 16-bit out_dtype is allowed its
rounding (the format's error model) on top of the f32 tolerance; partials and LSEs are
f32. Outputs are poisoned with the element type's NaN before each launch.
"""

from __future__ import annotations

import math

import numpy as np

from kgen import numpy_ref as ref
from kgen.ir.axes import Lse, Mask, SeqStarts
from kgen.ir.geometry import (
    MLA_LATENT,
    MLA_PREFILL_QK,
    MLA_PREFILL_V,
    MLA_ROPE,
    MLA_ROW,
    mla_split_keys,
)
from kgen.ir.kernel import Kernel
from kgen.testing.arguments import Makers, Mutation, always, zeros_like_shape
from kgen.testing.case import Case, bits_equal, rng
from kgen.testing.device import assert_close, assert_close_as, dev, poisoned, poisoned_as

f32 = np.float32

# concat_and_cache_mla: T tokens (n), S slots (0: T), pages of block_size, source rows
# padded (row_pad: strided kv_c and k_pe, odd pads leave rows unaligned to float4).
STORE = [
    Case("mla_store_t1", n=1, block_size=16),
    Case("mla_store_t37_pad8", n=37, block_size=16, row_pad=8),
    Case("mla_store_t100_s64_bs1", n=100, slots=64, block_size=1),
    Case("mla_store_t5_bs7_pad3", n=5, block_size=7, row_pad=3),
    Case("mla_store_t300_bs64", n=300, block_size=64),
    Case("mla_store_t64_s1_pad1", n=64, slots=1, block_size=16, row_pad=1),
]

# gather_mla_cache: (rows gathered, context rows) per request; slots: num_tokens (0:
# every gathered row); seq_starts (multiples of block_size) for seq_starts = given.
GATHER = [
    Case("mla_gather_r1_3", requests=((3, 3),), block_size=16),
    Case("mla_gather_r3", requests=((17, 17), (1, 40), (64, 64)), block_size=16),
    Case("mla_gather_r2_partial_n", requests=((20, 20), (5, 5)), block_size=16, slots=22),
    Case("mla_gather_r4_bs1", requests=((3, 3), (7, 7), (1, 1), (9, 9)), block_size=1),
    Case("mla_gather_r2_bs64", requests=((200, 200), (65, 65)), block_size=64),
]
GATHER_STARTS = [
    Case("mla_gather_starts_r3", requests=((10, 42), (16, 16), (1, 33)), block_size=16,
         seq_starts=(32, 0, 32)),
    Case("mla_gather_starts_r2_bs1", requests=((5, 9), (2, 2)), block_size=1,
         seq_starts=(4, 0)),
    Case("mla_gather_starts_r1_partial_n", requests=((70, 134),), block_size=32,
         seq_starts=(64,), slots=41),
]

# mla_decode / mla_combine: requests (1, seq_len), n_head q heads (16..128, and heads
# that fill no whole group), n_splits (1: one split; more than a request's tiles: empty
# splits), pages of block_size.
DECODE = [
    Case("mla_b1_l1_h16_s1", requests=((1, 1),), n_head=16, n_splits=1, block_size=16),
    Case("mla_b3_h16_s1", requests=((1, 17), (1, 300), (1, 5)), n_head=16, n_splits=1,
         block_size=16),
    Case("mla_b2_h16_s4", requests=((1, 1000), (1, 33)), n_head=16, n_splits=4,
         block_size=16),
    Case("mla_b2_h128_s3_bs64", requests=((1, 513), (1, 2)), n_head=128, n_splits=3,
         block_size=64),
    Case("mla_b1_h20_s2", requests=((1, 100),), n_head=20, n_splits=2, block_size=16),
    Case("mla_b1_h1_s7_bs1", requests=((1, 50),), n_head=1, n_splits=7, block_size=1),
    Case("mla_b1_h64_l4096_s8", requests=((1, 4096),), n_head=64, n_splits=8,
         block_size=16),
    Case("mla_b2_h32_s16_empty", requests=((1, 40), (1, 16)), n_head=32, n_splits=16,
         block_size=16),
    Case("mla_b4_h16_s2_bs5", requests=((1, 7), (1, 64), (1, 1), (1, 33)), n_head=16,
         n_splits=2, block_size=5),
]


# mla_prefill: (query rows, keys) per request, n_head heads: one row; chunks appended to a
# context (Lq < Lk); more rows than keys (causal rows that see none); an empty request
# (no query rows, or no keys); rows that fill no whole block.
PREFILL = [
    Case("mla_prefill_r1_1", requests=((1, 1),), n_head=1),
    Case("mla_prefill_r3_h4", requests=((5, 5), (3, 10), (17, 17)), n_head=4),
    Case("mla_prefill_r1_40_h16", requests=((40, 40),), n_head=16),
    Case("mla_prefill_more_rows_than_keys", requests=((7, 3),), n_head=2),
    Case("mla_prefill_r2_chunk_h8", requests=((100, 300), (64, 64)), n_head=8),
    Case("mla_prefill_r2_edges_h3", requests=((33, 1), (1, 33)), n_head=3),
    Case("mla_prefill_empty_requests", requests=((0, 5), (4, 4), (3, 0)), n_head=2),
    Case("mla_prefill_r1_129_h128", requests=((129, 129),), n_head=128),
]


# ---- layouts -----------------------------------------------------------------------------

def layout(case: Case, g: np.random.Generator | None = None) -> dict:
    """Block tables over shuffled pages (with ``g``), each request's context rows
    (``requests``' second entries) in whole blocks, one spare page nobody maps."""
    bs = case.block_size
    ctx = [c for _, c in case.requests]
    mb = max(-(-c // bs) for c in ctx)
    nb = len(ctx) * mb + 1
    phys = np.arange(nb, dtype=np.int32)
    if g is not None:
        g.shuffle(phys)
    table = phys[: len(ctx) * mb].reshape(len(ctx), mb).copy()
    return {"block_table": table, "seq_lens": np.array(ctx, np.int32), "num_blocks": nb}


def store_slots(case: Case, g: np.random.Generator | None = None) -> tuple[np.ndarray, int]:
    """(slot_mapping int64 [S], num_blocks): distinct slots over the pages (random, some
    -1, with ``g``; else 0..S-1). The last slot of the last page is never drawn: a store
    that wrote a -1 slot's row would land there (as Python's index -1 does), so the row
    it leaves stays the pages' old one, and such a fault always shows."""
    S = case.slots or case.n
    nb = -(-2 * S // case.block_size) + 1
    if g is None:
        return np.arange(S, dtype=np.int64), nb
    slots = g.permutation(nb * case.block_size - 1)[:S].astype(np.int64)
    slots[g.random(S) < 0.2] = -1
    return slots, nb


def gather_layout(case: Case) -> dict:
    lens = [r for r, _ in case.requests]
    starts = list(case.seq_starts) or [0] * len(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    n = case.slots or int(cu[-1])
    t2s = np.repeat(np.arange(len(lens), dtype=np.int32), lens)
    return {"cu_seq_lens": cu, "token_to_seq": t2s, "seq_starts": np.array(starts, np.int32),
            "num_tokens": n}


def prefill_layout(case: Case) -> dict:
    qlens = [q for q, _ in case.requests]
    klens = [kk for _, kk in case.requests]
    return {"cu_seqlens_q": np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32),
            "cu_seqlens_k": np.concatenate([[0], np.cumsum(klens)]).astype(np.int32),
            "max_seqlen_q": max(max(qlens), 1)}


def elems(k: Kernel) -> tuple[np.dtype, np.dtype]:
    """The NumPy dtypes of the kernel's in_dtype and out_dtype arrays."""
    return np.dtype(k.in_dtype.fmt.dtype), np.dtype(k.out_dtype.fmt.dtype)


# ---- contract mutations the decode stages share -----------------------------------------

def partials_mutations(op, m: str, l: str, acc: str) -> dict:
    """The mutations of a decode stage's split partials (``op``'s arguments ``m``, ``l``
    and ``acc``: mla_decode's outputs, mla_combine's inputs) and of its seq_lens."""
    mk = Makers(op)
    return {
        "mla_partials_heads": Mutation("shape", always, mk.replace_from_args(
            m, zeros_like_shape(lambda s: (s[0], s[1] + 1, s[2])))),
        "mla_partials_l_splits": Mutation("shape", always, mk.replace_from_args(
            l, zeros_like_shape(lambda s: (s[0], s[1], s[2] + 1)))),
        "mla_partials_acc_width": Mutation("shape", always, mk.replace_from_args(
            acc, zeros_like_shape(lambda s: (*s[:3], s[3] + 64)))),
        "mla_partials_flat": Mutation("shape", always, mk.replace_from_args(
            m, lambda x, a: np.zeros(x.size, x.dtype))),
        "mla_seq_lens_size": Mutation("shape", always, mk.replace_from_args(
            "seq_lens", lambda x, a: np.zeros(x.size + 1, x.dtype))),
    }


# ---- GPU checks --------------------------------------------------------------------------

def rand_elems(g, fmt, *shape) -> np.ndarray:
    """Random normal float32 values rounded to ``fmt``'s elements (its NumPy model)."""
    return fmt.quantize_rows(g.standard_normal(shape).astype(f32))


def widened(fmt, x) -> np.ndarray:
    """The float32 values a kernel computes with from ``fmt``'s elements (exact)."""
    return fmt.dequantize_rows(np.asarray(x))


def _strided_rows(g, fmt, rows: int, width: int, pad: int):
    """(host elements [rows][width], the device view: rows ``width + pad`` apart)."""
    wide = rand_elems(g, fmt, rows, width + pad)
    return wide[:, :width].copy(), dev(wide)[:, :width]


def check_store(k: Kernel, fn, case: Case) -> None:
    g, seed = rng()
    fi = k.in_dtype.fmt
    slots, nb = store_slots(case, g)
    old = rand_elems(g, fi, nb, case.block_size, MLA_ROW)
    kv_c, kv_dev = _strided_rows(g, fi, case.n, MLA_LATENT, case.row_pad)
    k_pe, pe_dev = _strided_rows(g, fi, case.n, MLA_ROPE, case.row_pad)
    cache = dev(old)
    fn(kv_dev, pe_dev, cache, dev(slots))
    want = ref.concat_and_cache_mla(old, kv_c, k_pe, slots)
    assert bits_equal(cache.get(), want), \
        f"{k.name}: the pages differ from the store's definition, seed={seed}"


def check_gather(k: Kernel, fn, case: Case) -> None:
    g, seed = rng()
    fi = k.in_dtype.fmt
    lay, gl = layout(case, g), gather_layout(case)
    pages = rand_elems(g, fi, lay["num_blocks"], case.block_size, MLA_ROW)
    n = gl["num_tokens"]
    dst = poisoned_as((n + 3, MLA_ROW), fi)  # rows past num_tokens must stay as they were
    given = k.seq_starts is SeqStarts.GIVEN
    arrays = [dst, dev(pages), dev(lay["block_table"]), dev(gl["cu_seq_lens"]),
              dev(gl["token_to_seq"])] + ([dev(gl["seq_starts"])] if given else [])
    fn(*arrays, num_tokens=n)
    got = dst.get()
    want = ref.gather_mla_cache(pages, lay["block_table"], gl["cu_seq_lens"],
                                gl["token_to_seq"], gl["seq_starts"] if given else None, n)
    assert bits_equal(got[:n], want), \
        f"{k.name}: workspace rows differ from the cache rows, seed={seed}"
    assert bool(np.isnan(widened(fi, got[n:])).all()), \
        f"{k.name}: wrote rows past num_tokens, seed={seed}"


def _decode_inputs(g, case: Case, fmt):
    """(layout, pages, queries): elements of ``fmt``."""
    lay = layout(case, g)
    pages = rand_elems(g, fmt, lay["num_blocks"], case.block_size, MLA_ROW)
    q = rand_elems(g, fmt, len(case.requests), case.n_head, MLA_ROW)
    return lay, pages, q


def check_decode(k: Kernel, fn, case: Case) -> None:
    g, seed = rng()
    fi = k.in_dtype.fmt
    lay, pages, q = _decode_inputs(g, case, fi)
    B, H, S = len(case.requests), case.n_head, case.n_splits
    scale = 1.0 / math.sqrt(MLA_ROW)
    m, l_, acc = poisoned((B, H, S)), poisoned((B, H, S)), poisoned((B, H, S, MLA_LATENT))
    fn(dev(q), dev(pages), dev(lay["block_table"]), dev(lay["seq_lens"]), m, l_, acc,
       scale=scale)
    m_ref, l_ref, acc_ref, live = ref.mla_decode_partials(
        widened(fi, q), widened(fi, pages), lay["block_table"], lay["seq_lens"], scale,
        MLA_LATENT, S, mla_split_keys)
    m_got, l_got, acc_got = m.get(), l_.get(), acc.get()
    on = np.broadcast_to(live[:, None, :], (B, H, S))
    assert_close(f"{k.name} m", m_got[on], m_ref[on], seed)
    assert_close(f"{k.name} l", l_got[on], l_ref[on], seed, rtol=8e-4)
    assert_close(f"{k.name} acc", acc_got[on], acc_ref[on], seed, rtol=8e-4, atol=1.6e-4)
    off = ~on
    assert bool(np.isnan(m_got[off]).all() and np.isnan(l_got[off]).all() and
                np.isnan(acc_got[off]).all()), \
        f"{k.name}: wrote partials of a split with no keys, seed={seed}"


def check_combine(k: Kernel, fn, case: Case) -> None:
    g, seed = rng()
    B, H, S = len(case.requests), case.n_head, case.n_splits
    lens = np.array([c for _, c in case.requests], np.int32)
    live = np.zeros((B, S), bool)
    for b, n in enumerate(lens):
        kps = mla_split_keys(int(n), S)
        live[b, : min(S, -(-int(n) // kps))] = True
    m = g.normal(0.0, 3.0, (B, H, S)).astype(f32)
    l_ = g.uniform(0.5, 20.0, (B, H, S)).astype(f32)
    acc = g.standard_normal((B, H, S, MLA_LATENT)).astype(f32)
    masked = live[:, None, :] & (g.random((B, H, S)) < 0.15)  # a split whose keys all
    m[masked], l_[masked] = -np.inf, 0.0                      # scored -inf
    acc[masked] = 0.0
    dead = ~np.broadcast_to(live[:, None, :], (B, H, S))
    m[dead], l_[dead], acc[dead] = np.nan, np.nan, np.nan  # must never be read
    fo = k.out_dtype.fmt
    out = poisoned_as((B, H, MLA_LATENT), fo)
    outs = [out] + ([poisoned((B, H))] if k.lse is Lse.WRITE else [])
    fn(dev(m), dev(l_), dev(acc), dev(lens), *outs)
    want, want_lse = ref.mla_merge(m, l_, acc, live)
    assert_close_as(f"{k.name} out", fo, out.get(), want, seed)
    if k.lse is Lse.WRITE:
        got_lse = outs[1].get()
        assert_close(f"{k.name} lse", got_lse[np.isfinite(want_lse)],
                     want_lse[np.isfinite(want_lse)], seed)
        assert bool(np.isneginf(got_lse[~np.isfinite(want_lse)]).all()), \
            f"{k.name}: a row with no scored key has an LSE other than -inf, seed={seed}"


def check_prefill(k: Kernel, fn, case: Case) -> None:
    g, seed = rng()
    lay = prefill_layout(case)
    Tq, Tk = int(lay["cu_seqlens_q"][-1]), int(lay["cu_seqlens_k"][-1])
    H = case.n_head
    fi, fo = k.in_dtype.fmt, k.out_dtype.fmt
    q = rand_elems(g, fi, Tq, H, MLA_PREFILL_QK)
    key = rand_elems(g, fi, max(Tk, 1), H, MLA_PREFILL_QK)[:Tk]
    value = rand_elems(g, fi, max(Tk, 1), H, MLA_PREFILL_V)[:Tk]
    scale = 1.0 / math.sqrt(MLA_PREFILL_QK)
    out = poisoned_as((Tq, H, MLA_PREFILL_V), fo)
    outs = [out] + ([poisoned((H, Tq))] if k.lse is Lse.WRITE else [])
    fn(dev(q), dev(np.ascontiguousarray(key)), dev(np.ascontiguousarray(value)),
       dev(lay["cu_seqlens_q"]), dev(lay["cu_seqlens_k"]), *outs,
       max_seqlen_q=lay["max_seqlen_q"], scale=scale)
    want, want_lse = ref.mla_prefill(widened(fi, q), widened(fi, key), widened(fi, value),
                                     lay["cu_seqlens_q"], lay["cu_seqlens_k"], scale,
                                     k.mask is Mask.CAUSAL)
    assert_close_as(f"{k.name} out", fo, out.get(), want, seed)
    if k.lse is Lse.WRITE:
        got = outs[1].get()
        seen = np.isfinite(want_lse)
        assert_close(f"{k.name} lse", got[seen], want_lse[seen], seed)
        assert bool(np.isneginf(got[~seen]).all()), \
            f"{k.name}: a row that sees no key has an LSE other than -inf, seed={seed}"
