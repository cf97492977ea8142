"""The engine-owned paged path on a GPU (kgen.runtime.engine): vLLM's layouts -- pages
[num_blocks, block_size, n_head_kv, head_dim], int32 block tables, int64 slot mappings,
one metadata object a step shared by every layer -- give the PagedKVCache's bits on the
same data, and the float64 attention of each sequence. Outputs are NaN-poisoned first;
inputs are drawn from a replayable seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.runtime import PagedKVCache, PagedMetadata, paged_attention, reshape_and_cache
from kgen.testing import rng
from kgen.testing.device import assert_close
from kgen.testing.paged import step_tensors

pytestmark = pytest.mark.gpu
HK, H, HD, NB, BS = 2, 8, 128, 32, 16


@pytest.fixture
def cp():
    import cupy

    return cupy


@pytest.mark.parametrize("kv", ["f32", "f16", "q8_0"])
def test_engine_pages_give_the_caches_bits(cp, kv):
    """Two layers' worth of steps (a prefill, two decode steps) over three sequences: the
    engine path writes its own copy of the pages through reshape_and_cache and attends
    through paged_attention; a PagedKVCache fed the same rows gives the same pages and
    bit-identical outputs; the f32 cache's outputs match the float64 reference."""
    g, seed = rng()
    cache = PagedKVCache(NB, BS, HK, HD, kv=kv)
    sids = [cache.add() for _ in range(3)]
    k_pages = cp.zeros_like(cache.k)
    v_pages = cp.zeros_like(cache.v)
    seqs = {s: ([], [], []) for s in sids}
    for step, rows in enumerate(([7, 20, 1], [1, 1, 1], [1, 1, 1])):
        T = sum(rows)
        q, k, v = (g.standard_normal((T, h, HD)).astype(np.float32) for h in (H, HK, HK))
        qsl, lens, table, slots = step_tensors(cache, sids, rows)
        meta = PagedMetadata(cp.asarray(qsl), cp.asarray(lens), cp.asarray(table),
                             cp.asarray(slots), max(rows), int(lens.max()))
        dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
        reshape_and_cache(dk, dv, k_pages, v_pages, meta, kv_cache_dtype=kv)
        out = cp.full((T, H, HD), np.nan, np.float32)
        paged_attention(dq, k_pages, v_pages, meta, out, kv_cache_dtype=kv)
        if max(rows) > 1:
            mine = cache.prefill(sids, dq, dk, dv, rows)
        else:
            mine = cache.decode(sids, dq, dk, dv)
        cp.cuda.Device().synchronize()
        assert cp.array_equal(k_pages, cache.k) and cp.array_equal(v_pages, cache.v), \
            f"pages differ at step {step}, seed={seed}"
        got, want_bits = out.get(), mine.get()
        assert np.array_equal(got.view(np.int32), want_bits.view(np.int32)), \
            f"not the cache's bits at step {step}, seed={seed}"
        at = 0
        for s, n in zip(sids, rows, strict=True):
            for part, x in zip(seqs[s], (q[at:at + n], k[at:at + n], v[at:at + n]),
                               strict=True):
                part.append(x)
            at += n
        if kv == "f32":
            at = 0
            for s, n in zip(sids, rows, strict=True):
                qs, ks, vs = (np.concatenate(p) for p in seqs[s])
                want = ref.attention_dense(qs, ks, vs, 1 / math.sqrt(HD), True)[-n:]
                assert_close(f"seq {s} step {step}", got[at:at + n], want, seed)
                at += n
