"""The DFlash block attention entry points on a GPU (kgen.runtime.dflash): against the
float64 references of the definition (f32, and every 16-bit element type pair, the
kernel chosen by the arrays' dtypes); the paged call replayed from a CUDA graph while
the index arrays it reads in place change between replays (bit for bit the direct
call's); and index entries that break the contract under validate=False giving NaN rows
for their request (zeros outside every request), the other requests untouched."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.ir.axes import IoDtype
from kgen.runtime import dflash_block_attention, dflash_paged_block_attention
from kgen.testing import rng
from kgen.testing.device import assert_close_as

pytestmark = pytest.mark.gpu
RTOL, ATOL = 2e-4, 2e-5
H, HK, BS = 8, 2, 16


def _ws(window: int):
    """The kernels' sliding window W (<= 0: none) as the public window_size (W - 1, 0)."""
    return (window - 1, 0) if window > 0 else None


def _rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def _paged_inputs(g, blocks, ctxs, D, pages=None):
    T = sum(blocks)
    need = [-(-c // BS) for c in ctxs]
    pages = pages or sum(need) + 2
    mb = max([1, *need]) + 1
    perm = g.permutation(pages)
    table = np.full((len(blocks), mb), -1, np.int32)
    at = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[at:at + n]
        at += n
    return dict(q=_rand(g, T, H, D), bk=_rand(g, T, HK, D), bv=_rand(g, T, HK, D),
                ck=_rand(g, pages, BS, HK, D), cv=_rand(g, pages, BS, HK, D),
                cu=np.concatenate([[0], np.cumsum(blocks)]).astype(np.int32),
                lens=np.array(ctxs, np.int32), table=table)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal, window", [(False, 0), (True, 0), (True, 5)])
def test_entry_points_against_the_references(D, causal, window):
    import cupy as cp

    g, seed = rng()
    scale = 1 / math.sqrt(D)
    x = _paged_inputs(g, [16, 1, 9], [40, 0, 123], D)
    out = cp.full(x["q"].shape, np.nan, cp.float32)
    d = {n: cp.asarray(v) for n, v in x.items()}
    cp.cuda.Device().synchronize()
    dflash_paged_block_attention(out, d["q"], d["bk"], d["bv"], d["ck"], d["cv"], d["cu"],
                                 d["lens"], d["table"], scale=scale, causal=causal,
                                 window_size=_ws(window), num_reqs=3, block_size=BS)
    want = ref.dflash_paged_block_attention(x["q"], x["bk"], x["bv"], x["ck"], x["cv"],
                                            x["cu"], x["lens"], x["table"], scale, causal,
                                            window)
    np.testing.assert_allclose(out.get(), want, rtol=RTOL, atol=ATOL,
                               err_msg=f"paged, seed={seed}")
    out = cp.full(x["q"].shape, np.nan, cp.float32)
    dflash_block_attention(out, d["q"], d["bk"], d["bv"], d["cu"], scale=scale,
                           causal=causal, window_size=_ws(window), num_reqs=3)
    want = ref.dflash_block_attention(x["q"], x["bk"], x["bv"], x["cu"], scale, causal,
                                      window)
    np.testing.assert_allclose(out.get(), want, rtol=RTOL, atol=ATOL,
                               err_msg=f"dense, seed={seed}")


@pytest.mark.parametrize("fi, fo", [(IoDtype.BF16, IoDtype.BF16), (IoDtype.BF16, IoDtype.F32),
                                    (IoDtype.F16, IoDtype.F16), (IoDtype.F16, IoDtype.F32)])
@pytest.mark.parametrize("causal, window", [(False, 0), (True, 5)])
def test_16bit_entry_points_against_the_references(fi, fo, causal, window):
    """16-bit query, keys, values and pages (bf16 bits, halves): the output of out's type
    within the f32 tolerance plus its rounding; the paged call the dense call's bits over
    [context ; block] of a request without context."""
    import cupy as cp

    g, seed = rng()
    D = 128
    scale = 1 / math.sqrt(D)
    x = _paged_inputs(g, [16, 1, 9], [40, 0, 123], D)
    x = {n: fi.fmt.quantize_rows(v) if v.dtype == np.float32 else v for n, v in x.items()}
    d = {n: cp.asarray(v) for n, v in x.items()}

    def poisoned():
        return cp.full(x["q"].shape, fo.fmt.poison(), np.dtype(fo.fmt.dtype))
    paged, dense = poisoned(), poisoned()
    cp.cuda.Device().synchronize()
    dflash_paged_block_attention(paged, d["q"], d["bk"], d["bv"], d["ck"], d["cv"], d["cu"],
                                 d["lens"], d["table"], scale=scale, causal=causal,
                                 window_size=_ws(window), num_reqs=3, block_size=BS)
    dflash_block_attention(dense, d["q"], d["bk"], d["bv"], d["cu"], scale=scale,
                           causal=causal, window_size=_ws(window), num_reqs=3)
    want = ref.dflash_paged_block_attention(x["q"], x["bk"], x["bv"], x["ck"], x["cv"],
                                            x["cu"], x["lens"], x["table"], scale, causal,
                                            window)
    got = paged.get()
    assert_close_as("paged", fo.fmt, got, want, seed)
    want = ref.dflash_block_attention(x["q"], x["bk"], x["bv"], x["cu"], scale, causal,
                                      window)
    assert_close_as("dense", fo.fmt, dense.get(), want, seed)
    # request 1 has no context: its one row is the dense call's, bit for bit
    u = np.dtype(f"u{got.dtype.itemsize}")
    assert np.array_equal(got[16:17].view(u), dense.get()[16:17].view(u)), f"seed={seed}"


def test_paged_graph_replay_reads_the_index_arrays_in_place():
    import cupy as cp

    g, seed = rng()
    D, R, T = 128, 3, 3 * 8
    pages = 40
    stream = cp.cuda.Stream(non_blocking=True)
    x = _paged_inputs(g, [8, 8, 8], [30, 5, 77], D, pages=pages)
    mb = 12
    dev = {n: cp.asarray(v) for n, v in x.items() if n not in ("table",)}
    dev["table"] = cp.full((R, mb), -1, cp.int32)
    out = cp.full((T, H, D), np.nan, cp.float32)
    direct = cp.full((T, H, D), np.nan, cp.float32)
    args = lambda o: (o, dev["q"], dev["bk"], dev["bv"], dev["ck"], dev["cv"], dev["cu"],  # noqa: E731
                      dev["lens"], dev["table"])

    def step_inputs(step):
        """New block split, context lengths and pages, written in place."""
        blocks = g.multinomial(T, [1 / R] * R) if step else np.array([8, 8, 8])
        ctxs = g.integers(0, mb * BS + 1, R)
        table = np.full((R, mb), -1, np.int32)
        perm = g.permutation(pages)
        at = 0
        for r, c in enumerate(ctxs):  # at most R * mb = 36 of the 40 pages
            n = -(-int(c) // BS)
            table[r, :n] = perm[at:at + n]
            at += n
        cu = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int32)
        dev["cu"].set(cu, stream=stream)
        dev["lens"].set(ctxs.astype(np.int32), stream=stream)
        dev["table"].set(table, stream=stream)
        with stream:
            out.fill(np.nan)
            direct.fill(np.nan)
        stream.synchronize()  # the validated calls read them back on another stream
        return cu, ctxs.astype(np.int32), table

    meta = step_inputs(0)
    dflash_paged_block_attention(*args(out), scale=0.1, causal=True, window_size=(19, 0),
                                 stream=stream)  # loads the kernel, validated
    with stream:
        stream.begin_capture()
        dflash_paged_block_attention(*args(out), scale=0.1, causal=True, window_size=(19, 0),
                                     validate=False, stream=stream)
        graph = stream.end_capture()
    for step in range(1, 6):
        meta = step_inputs(step)
        graph.launch(stream)
        dflash_paged_block_attention(*args(direct), scale=0.1, causal=True,
                                     window_size=(19, 0), stream=stream)
        stream.synchronize()
        got, want_bits = out.get(), direct.get()
        assert np.array_equal(got.view(np.uint32), want_bits.view(np.uint32)), \
            f"graph step {step} differs from the direct call, seed={seed}"
        want = ref.dflash_paged_block_attention(x["q"], x["bk"], x["bv"], x["ck"], x["cv"],
                                                *meta, 0.1, True, 20)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"graph step {step}, seed={seed}")


def test_broken_index_entries_give_nan_rows_and_no_fault():
    import cupy as cp

    g, seed = rng()
    D = 64
    x = _paged_inputs(g, [4, 5, 3], [20, 9, 17], D)
    good = ref.dflash_paged_block_attention(x["q"], x["bk"], x["bv"], x["ck"], x["cv"],
                                            x["cu"], x["lens"], x["table"], 0.2, False)
    lens = x["lens"].copy()
    lens[0] = 10**6                       # request 0: a context past its table row
    table = x["table"].copy()
    table[2, 0] = 10**6                   # request 2: a page outside the cache
    cu = x["cu"].copy()
    cu[-1] = cu[-2] + 1                   # request 2 keeps 1 of its 3 rows: 2 outside
    out = cp.full(x["q"].shape, np.nan, cp.float32)
    d = {n: cp.asarray(v) for n, v in dict(x, lens=lens, table=table, cu=cu).items()}
    cp.cuda.Device().synchronize()
    dflash_paged_block_attention(out, d["q"], d["bk"], d["bv"], d["ck"], d["cv"], d["cu"],
                                 d["lens"], d["table"], scale=0.2, validate=False)
    got = out.get()
    cp.cuda.Device().synchronize()
    assert np.isnan(got[0:4]).all(), f"request 0 rows are not NaN, seed={seed}"
    np.testing.assert_allclose(got[4:9], good[4:9], rtol=RTOL, atol=ATOL,
                               err_msg=f"request 1, seed={seed}")
    assert np.isnan(got[9]).all(), f"request 2's row is not NaN, seed={seed}"
    assert (got[10:] == 0).all(), f"rows outside every request are not zeros, seed={seed}"
