"""The split query-tile prefill on the GPU (key_split = partials): one split and the
combine give its whole twin's bits; many splits match float64; a cache's chunk that
leaves the device's SMs idle runs split (its kernel and count from the device) and
matches float64, and one paged request splits as the dense chunk, bit for bit. (Each
split kernel's generated test folds 3 splits in float64: tests/kernels.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.ir.geometry import key_partials
from kgen.testing import rng

pytestmark = pytest.mark.gpu
RTOL, ATOL = 2e-4, 2e-5


def _rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def _pairs() -> list[tuple[str, str]]:
    """(whole, split) of every dense split twin."""
    from kgen.runtime.select import generated, split_twin

    pool = generated()
    return [(k.name, t[0].name) for k, _ in pool if k.position.value == "host"
            for t in [split_twin(k, pool)] if t is not None]


def _kernel(name: str):
    from kgen.runtime.select import generated

    return next((k, f) for k, f in generated() if k.name == name)


@pytest.mark.parametrize("whole, split", _pairs(), ids=[s for _, s in _pairs()])
def test_one_split_and_the_combine_give_the_whole_bits(whole, split):
    """A chunk after a context: the split kernel at 1 split + the combine kernel vs the
    whole kernel, bit for bit (an options kernel with an exact window and soft-cap, its
    sinks -inf: split 0 folds a finite sink in another order); at 5 splits + the combine
    (finite sinks) against float64. A format with fp16 shadows keeps 4 sink rows and a
    64-row window, so some tiles of the chunk read the ring."""
    import cupy as cp

    from kgen.ir.axes import Sinks
    from kgen.runtime.kv import KVCache

    kw, fw = _kernel(whole)
    ks, fs = _kernel(split)
    g, seed = rng()
    hd = min(kw.max_head_dim, 128)
    hk, G, n, ctx = 2, 4, 37, 300
    H = hk * G
    sink, win = (4, 64) if kw.pair.shadows else (0, 0)
    cache = KVCache(hk, hd, ctx + n, kv=kw.kv.value, sink=sink, win=win)
    cached = (cache.k, cache.v, *cache.shadows)
    k_all, v_all = _rand(g, ctx + n, hk, hd), _rand(g, ctx + n, hk, hd)
    cache.append(cp.asarray(k_all), cp.asarray(v_all), 0)
    q = _rand(g, n, H, hd)
    qd = cp.asarray(q)
    _, fc = cache.kernels.get("combine")
    learned = kw.sinks is Sinks.LEARNED
    sinks = g.standard_normal(H).astype(np.float32)
    window = (200, 0) if kw.window.value == "exact" else None
    softcap = 3.0 if kw.softcap.value == "tanh" else 0.0
    opt = {**({"win_left": window[0], "win_right": window[1]} if window else {}),
           **({"softcap": softcap} if softcap else {})}

    def with_sinks(values):
        return {"sinks": cp.asarray(values)} if learned else {}

    out = cp.full((n, H, hd), np.nan, cp.float32)
    fw(qd, *cached, out, pos0=ctx, **cache._shadow_args, **opt,
       **with_sinks(np.full(H, -np.inf, np.float32)))
    outs = {}
    for S in (1, 5):
        heads = n * H
        m, l = (cp.full(heads * S, np.nan, cp.float32) for _ in range(2))
        acc = cp.full(heads * S * hd, np.nan, cp.float32)
        fs(qd, *cached, m, l, acc, pos0=ctx, n_splits=S, **cache._shadow_args, **opt,
           **with_sinks(np.full(H, -np.inf, np.float32) if S == 1 else sinks))
        o = cp.full((heads, hd), np.nan, cp.float32)
        fc(m, l, acc, o, n_splits=S)
        outs[S] = o.get().reshape(n, H, hd)
    a = out.get()
    assert not np.isnan(a).any(), f"{whole}: NaN left, seed={seed}"
    assert np.array_equal(outs[1].view(np.uint32), a.view(np.uint32)), \
        f"{split} at 1 split vs {whole}, seed={seed}"
    host = ref.HostCache.empty(cache.pair, hk, ctx + n, hd, *(
        (ks.ring_rows, ks.sink_rows) if kw.pair.shadows else (0, 0)))
    ref.append(k_all, v_all, host, 0, sink=sink, win=win)
    floor = (ref.prefill_live_floor(ctx, n, ks.ring_rows)
             if ks.ring_floor.value == "batch" else None)
    want = ref.prefill_attention_cache(q, host, G, ctx, sink, win, 0, 0, 1 / math.sqrt(hd),
                                       floor, tile=ks.tile_keys,
                                       full=ks.mask.value == "full",
                                       window=window, softcap=softcap,
                                       sinks=sinks if learned else None)
    np.testing.assert_allclose(outs[5], want, rtol=RTOL, atol=ATOL,
                               err_msg=f"{split} at 5 splits, seed={seed}")


@pytest.mark.parametrize("kv", ["f32", "f16", "q8_0", "fp8_e4m3", "bf16"])
@pytest.mark.parametrize("opt", [{}, {"window_size": (700, 0), "softcap": 4.0, "sinks": True}],
                         ids=["plain", "options"])
def test_a_chunk_that_leaves_sms_idle_runs_split(kv, opt):
    """128 rows after 1920 keys at 32/8 heads, head_dim 128 (64 blocks): on a device
    with more than 32 SMs the cache splits the chunk (with an exact window, soft-cap and
    sinks too: split 0 folds the sinks); against float64 for every row, and one paged
    request of the same rows gives the dense bits."""
    import cupy as cp

    from kgen.runtime.kv import KVCache
    from kgen.runtime.paged import PagedKVCache
    from kgen.runtime.select import generated

    g, seed = rng()
    hd, hk, H, rows, ctx = 128, 8, 32, 128, 1920
    dense = KVCache(hk, hd, ctx + rows, kv=kv)
    paged = PagedKVCache(hk * 33, 64, hk, hd, kv=kv)
    sid = paged.add()
    k_all, v_all = _rand(g, ctx + rows, hk, hd), _rand(g, ctx + rows, hk, hd)
    q0 = cp.asarray(_rand(g, ctx, H, hd))
    dense.prefill(q0, cp.asarray(k_all[:ctx]), cp.asarray(v_all[:ctx]), pos0=0)
    paged.prefill([sid], q0, cp.asarray(k_all[:ctx]), cp.asarray(v_all[:ctx]), [ctx])
    q = _rand(g, rows, H, hd)
    sinks = g.standard_normal(H).astype(np.float32) if opt.get("sinks") else None
    kw = {**opt, "sinks": None if sinks is None else cp.asarray(sinks)}
    b = dense.prefill(cp.asarray(q), cp.asarray(k_all[ctx:]), cp.asarray(v_all[ctx:]),
                      pos0=ctx, **kw).get()
    a = paged.prefill([sid], cp.asarray(q), cp.asarray(k_all[ctx:]), cp.asarray(v_all[ctx:]),
                      [rows], **kw).get()
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    k = next(x for x, _ in generated() if x.name == (dense.last_prefill_split
                                                      or dense.last_prefill))
    if sms > 32:  # two resident blocks an SM: 64 blocks leave SMs idle
        assert key_partials(k) and dense.last_prefill_splits > 1, dense.last_prefill
    assert paged.last_prefill_splits == dense.last_prefill_splits
    host = ref.HostCache.empty(dense.pair, hk, ctx + rows, hd, 0, 0)
    ref.append(k_all, v_all, host, 0)
    want = ref.prefill_attention_cache(q, host, H // hk, ctx, 0, 0, 0, 0, 1 / math.sqrt(hd),
                                       tile=k.tile_keys, window=opt.get("window_size"),
                                       softcap=opt.get("softcap", 0.0), sinks=sinks)
    np.testing.assert_allclose(b, want, rtol=RTOL, atol=ATOL,
                               err_msg=f"{kv} {dense.last_prefill} x "
                               f"{dense.last_prefill_splits}, seed={seed}")
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
        f"{kv} paged ({paged.last_prefill}) vs dense ({dense.last_prefill}), seed={seed}"
