"""Caches at every group bound of the decodes, on the GPU: a count at each decode's bound
(the caches take the tightest that serves it: tests/cpu/test_group_bounds.py), one below
each (the bound's last head padded: a quads decode scores it from q row 0 and weighs it 0),
and one past every decode's bound (the step then runs as a one-row prefill through the
query tile), dense, per slot and paged, each output against the float64 reference of its
keys. The group counts come from the built kernels."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.formats import pair
from kgen.testing import rng

pytestmark = pytest.mark.gpu
RTOL, ATOL = 2e-4, 2e-5
MS = 96


def _group_counts(kv: str, hd: int) -> list[int]:
    """Every group bound of a decode serving ``kv`` at ``hd``, one below each, and one past
    the largest (served by the query tile's one-row prefill)."""
    from kgen.ir.axes import Mode, Op
    from kgen.runtime.bind import shape_refusal
    from kgen.runtime.select import generated

    bounds = {k.max_groups for k, _ in generated()
              if k.op is Op.FLASH and k.mode is Mode.DECODE and k.kv.value == kv
              and k.v_kv.value == kv and shape_refusal(k, hd, k.max_groups) is None}
    return sorted({c for b in bounds for c in (b - 1, b) if c > 0} | {max(bounds) + 1})


SHAPES = [(kv, hd, G) for kv in ("f32", "bf16", "q8_0") for hd in (64, 128)
          for G in _group_counts(kv, hd)]


def _rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("kv, hd, G", SHAPES)
def test_dense_prefill_then_decode(kv, hd, G):
    import cupy as cp

    from kgen.runtime.kv import KVCache

    g, seed = rng()
    HK = 1
    H = G * HK
    cache = KVCache(HK, hd, MS, kv=kv)
    host = ref.HostCache.empty(pair(kv), HK, MS, hd)
    scale = 1 / math.sqrt(hd)
    n = 37
    q, kn, vn = _rand(g, n, H, hd), _rand(g, n, HK, hd), _rand(g, n, HK, hd)
    out = cache.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), 0).get()
    ref.append(kn, vn, host, 0)
    want = ref.prefill_attention_cache(q, host, G, 0, 0, 0, 0, 0, scale, max_groups=G)
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL,
                               err_msg=f"{kv} hd{hd} G{G} prefill seed={seed}")
    for pos in (n, n + 1):
        q1, k1, v1 = _rand(g, H, hd), _rand(g, 1, HK, hd), _rand(g, 1, HK, hd)
        out = cache.decode(cp.asarray(q1), cp.asarray(k1), cp.asarray(v1), pos).get()
        ref.append(k1, v1, host, pos)
        kr, vr = ref.read_kv_rows(host, pos)
        want = ref.decode_attention(q1, kr, vr, G, pos + 1, pos + 1, 1, 0, 0, scale,
                                    max_groups=G)
        np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{kv} hd{hd} G{G} decode at {pos} "
                                   f"({cache.last_plan}) seed={seed}")


@pytest.mark.parametrize("kv, hd, G", [s for s in SHAPES if s[0] != "bf16"])
def test_slot_and_paged_decode(kv, hd, G):
    import cupy as cp

    from kgen.runtime.kv import SlotKVCache
    from kgen.runtime.paged import PagedKVCache

    g, seed = rng()
    HK = 1
    H = G * HK
    scale = 1 / math.sqrt(hd)
    lens = [5, 40, 17]
    ks = [_rand(g, n + 1, HK, hd) for n in lens]  # every row of each sequence, the
    vs = [_rand(g, n + 1, HK, hd) for n in lens]  # decode's last
    q1 = _rand(g, len(lens), H, hd)

    def want(i):
        host = ref.HostCache.empty(pair(kv), HK, lens[i] + 1, hd)
        ref.append(ks[i], vs[i], host, 0)
        kr, vr = ref.read_kv_rows(host, lens[i])
        return ref.decode_attention(q1[i], kr, vr, G, lens[i] + 1, lens[i] + 1, 1, 0, 0,
                                    scale, max_groups=G)

    slots = SlotKVCache(len(lens), HK, hd, MS, kv=kv)
    for u, n in enumerate(lens):
        slots.slot(u).append(cp.asarray(ks[u][:n]), cp.asarray(vs[u][:n]), 0)
    got = slots.decode(cp.asarray(q1), cp.asarray(np.stack([k[-1] for k in ks])),
                       cp.asarray(np.stack([v[-1] for v in vs])), lens).get()
    for i in range(len(lens)):
        np.testing.assert_allclose(got[i], want(i), rtol=RTOL, atol=ATOL,
                                   err_msg=f"{kv} hd{hd} G{G} slot {i} seed={seed}")

    paged = PagedKVCache(16, 16, HK, hd, kv=kv)
    sids = [paged.add() for _ in lens]
    paged.append(sids, cp.asarray(np.concatenate([k[:-1] for k in ks])),
                 cp.asarray(np.concatenate([v[:-1] for v in vs])), lens)
    got = paged.decode(sids, cp.asarray(q1), cp.asarray(np.stack([k[-1] for k in ks])),
                       cp.asarray(np.stack([v[-1] for v in vs]))).get()
    for i in range(len(lens)):
        np.testing.assert_allclose(got[i], want(i), rtol=RTOL, atol=ATOL,
                                   err_msg=f"{kv} hd{hd} G{G} paged seq {i} seed={seed}")
