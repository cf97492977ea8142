"""Alignment contracts on a GPU: CuPy arrays carved out of one byte buffer at chosen
offsets (a view into a byte buffer, what an engine's arena hands out). An array off the
boundary its kernel's widest access needs (kgen.ir.signature.Param.align) is a
ContractError before anything launches: the poisoned output stays NaN and the cache's
length is as it was. On its boundary, but off every wider one, the call runs (no replay
of a binding made at 16-byte boundaries skips the check, and none is needed) and every
element is checked against the float64 reference (a copy: bit for bit)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.formats import FORMATS
from kgen.ir.geometry import MLA_ROW
from kgen.runtime import ContractError, KVCache, attention_dense_fast, gather_mla_cache
from kgen.testing import rng
from kgen.testing.device import assert_close_as

pytestmark = pytest.mark.gpu
F32 = FORMATS["f32"]


@pytest.fixture
def cp():
    import cupy

    return cupy


def _carved(cp, x: np.ndarray, offset: int):
    """A CuPy array holding ``x`` that starts ``offset`` bytes into a fresh allocation
    (256-byte aligned, as CUDA allocates)."""
    buf = cp.empty(x.nbytes + 256, np.uint8)
    a = cp.ndarray(x.shape, x.dtype, memptr=buf.data + offset)
    a.set(np.ascontiguousarray(x))
    return a


def _poisoned(cp, shape, offset: int):
    return _carved(cp, np.full(shape, np.nan, np.float32), offset)


def test_dense_attention_refuses_a_view_off_its_element_and_runs_on_one(cp):
    g, seed = rng()
    T, H, hk, D = 24, 4, 2, 64
    q, k, v = (g.standard_normal((T, h, D)).astype(np.float32) for h in (H, hk, hk))
    out = _poisoned(cp, (T, H, D), 0)
    for bad in (2, 6):  # half a float off: every kernel reading q faults or reads garbage
        with pytest.raises(ContractError) as e:
            attention_dense_fast(out, _carved(cp, q, bad), _carved(cp, k, 0),
                                 _carved(cp, v, 0), causal=True)
        assert e.value.contract == "alignment", seed
        assert e.value.message.startswith("query must start on a 4-byte boundary"), seed
    cp.cuda.Device().synchronize()
    assert bool(cp.isnan(out).all()), f"written before the refusal, seed={seed}"
    for offsets in ((4, 8, 12, 20), (0, 0, 0, 0), (4, 8, 12, 20)):  # again: no replay
        out = _poisoned(cp, (T, H, D), offsets[3])
        attention_dense_fast(out, *(_carved(cp, x, o) for x, o in zip((q, k, v), offsets[:3],
                                                                         strict=True)),
                             causal=True)
        cp.cuda.Device().synchronize()
        assert_close_as(f"dense at {offsets}", F32, out.get(),
                        ref.attention_dense(q, k, v, 1 / math.sqrt(D), True), seed)


def test_a_cache_refuses_rows_off_their_element_before_it_appends(cp):
    g, seed = rng()
    H, hk, D, n = 4, 2, 128, 9
    q, k, v = (g.standard_normal((n, h, D)).astype(np.float32) for h in (H, hk, hk))
    c = KVCache(hk, D, 64, kv="f32")
    with pytest.raises(ContractError) as e:
        c.prefill(_carved(cp, q, 0), _carved(cp, k, 2), _carved(cp, v, 0), pos0=0)
    assert e.value.contract == "alignment", seed
    assert e.value.message.startswith("k_new must start on a 4-byte boundary"), seed
    assert c.length == 0, f"appended before the refusal, seed={seed}"
    out = c.prefill(_carved(cp, q, 4), _carved(cp, k, 8), _carved(cp, v, 12), pos0=0)
    cp.cuda.Device().synchronize()
    assert c.length == n
    assert_close_as("prefill", F32, out.get(),
                    ref.attention_dense(q, k, v, 1 / math.sqrt(D), True), seed)


def test_gather_refuses_a_workspace_off_its_float4s_and_copies_on_them(cp):
    """gather_mla_cache copies rows a float4 at a time: dst and src_cache on 16 bytes."""
    g, seed = rng()
    nb, bs, n = 4, 16, 20
    pages = g.standard_normal((nb, bs, MLA_ROW)).astype(np.float32)
    table = np.array([[2, 0, 3, 1]], np.int32)
    cu, t2s = np.array([0, n], np.int32), np.zeros(n, np.int32)
    src = _carved(cp, pages, 16)
    idx = [cp.asarray(x) for x in (table, cu, t2s)]
    for at in (4, 8):
        dst = _poisoned(cp, (n, MLA_ROW), at)
        with pytest.raises(ContractError) as e:
            gather_mla_cache(dst, src, *idx, None, n)
        assert e.value.contract == "alignment", seed
        assert e.value.message.startswith("dst must start on a 16-byte boundary"), seed
        cp.cuda.Device().synchronize()
        assert bool(cp.isnan(dst).all()), f"written before the refusal, seed={seed}"
    with pytest.raises(ContractError):
        gather_mla_cache(_poisoned(cp, (n, MLA_ROW), 0), _carved(cp, pages, 8), *idx, None, n)
    dst = _poisoned(cp, (n, MLA_ROW), 48)
    gather_mla_cache(dst, src, *idx, None, n)
    cp.cuda.Device().synchronize()
    want = pages[table[0]].reshape(nb * bs, MLA_ROW)[:n]
    np.testing.assert_array_equal(dst.get(), want, err_msg=f"seed={seed}")
