"""`make bench-host`: the host-side Python of kgen's launch paths, timed on any
machine. CuPy is replaced by kgen.testing.fakecupy (arrays are attribute bags,
kernel functions do nothing), so what is timed is kgen's own work per call,
beside a bare call of the fake kernel function with prepared arguments: the
"raw CuPy launch" of ``make bench-kernels``' launch table minus CuPy.

  launcher   the generated launcher of the f32 split decode, a memo hit
  decode     KVCache.decode, one f32 step (append + split + combine), plan given
  default    the same with no plan (the tuned plan is asked each step)
  paged      PagedKVCache.decode of 32 sequences (tables, lengths and slots built and
             uploaded in Python each call), beside the engine-owned path: PagedMetadata
             once a step (validated: read back and checked), then per layer
             reshape_and_cache + paged_attention (kgen.runtime.engine)

Each arm runs in rounds of back-to-back calls; the best round is reported (µs
per call), and the overhead over the raw calls the arm makes.
"""

from __future__ import annotations

import sys
import time

HK, H, HD, SEQ, KPS, CAP = 2, 16, 256, 4096, 256, 16
ROUNDS, CALLS = 15, 20000


def _best(fn, calls: int = CALLS) -> float:
    for _ in range(calls // 10):
        fn()
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> int:
    if "cupy" in sys.modules:
        raise SystemExit("kgen.bench.host replaces CuPy: run it in a fresh process")
    from kgen.testing.fakecupy import FakeCupy

    cp = FakeCupy(record=False)
    sys.modules["cupy"] = cp
    from kgen.runtime import launch
    from kgen.runtime.kv import KVCache
    from kgen.runtime.plan import decode_plan

    launch.function = cp.function
    cache = KVCache(HK, HD, SEQ, kv="f32")
    q, k1, v1 = cp.empty((H, HD)), cp.empty((1, HK, HD)), cp.empty((1, HK, HD))
    kd, fdec = cache.kernels.get("decode", H // HK)
    plan = decode_plan(SEQ, KPS, CAP, kd.tile_keys)
    m, l, acc = cache.scratch.get(H, plan.n_splits, HD)
    b = fdec(q, cache.k, cache.v, m, l, acc, seq_len=SEQ, n_splits=plan.n_splits,
             split_len=plan.split_len)
    raw_f = cp.function(None, b.kernel, 0)

    def raw():
        raw_f(b.grid, b.block, b.args, shared_mem=b.shared_bytes)

    def launcher():
        fdec(q, cache.k, cache.v, m, l, acc, seq_len=SEQ, n_splits=plan.n_splits,
             split_len=plan.split_len)

    def step():
        cache.length = 0
        cache.decode(q, k1, v1, pos=SEQ - 1, kps=KPS, splits_cap=CAP)

    def default():
        cache.length = 0
        cache.decode(q, k1, v1, pos=SEQ - 1)

    def empty():
        cp.empty((H, HD), cp.float32)

    r, e = _best(raw), _best(empty)
    print(f"{'raw call (fake CuPy function)':36s} {r:7.2f} µs")
    print(f"{'cp.empty of the output (fake CuPy)':36s} {e:7.2f} µs")
    for name, fn, raws in (("generated launcher (memo hit)", launcher, 1),
                           ("KVCache.decode, plan given", step, 3),
                           ("KVCache.decode, no plan", default, 3)):
        t = _best(fn, CALLS // raws)
        extra = t - raws * r - (e if raws == 3 else 0)
        print(f"{name:36s} {t:7.2f} µs  (kgen: {extra:5.2f} µs over {raws} raw"
              f"{' + cp.empty' if raws == 3 else ''})")
    _paged(cp)
    return 0


def _paged(cp, batch: int = 32, keys: int = 4096, block: int = 16) -> None:
    """32 sequences of 4k keys, f32 pages, 32/8 heads at head_dim 128: the cache object's
    decode step against the engine's step (metadata) and layer (two calls)."""
    import numpy as np

    from kgen.runtime import PagedKVCache, PagedMetadata, paged_attention, reshape_and_cache
    from kgen.testing.paged import step_tensors

    hk, h, hd = 8, 32, 128
    cache = PagedKVCache(batch * (keys // block + 1), block, hk, hd, kv="f32")
    sids = [cache.add() for _ in range(batch)]
    for s in sids:
        cache.lengths[s] = keys - 1
        cache.tables[s] = [cache.free_blocks.pop() for _ in range(keys // block)]
    q, k = cp.empty((batch, h, hd)), cp.empty((batch, hk, hd))
    qsl, lens, table, slots = (cp.asarray(x) for x in step_tensors(cache, sids, [1] * batch))
    args = (qsl, lens, table, slots, 1, keys)
    meta = PagedMetadata(*args)
    out = cp.empty((batch, h, hd))

    def cache_step():
        for s in sids:  # the step, undone: every call is the same decode
            cache.lengths[s] = keys - 1
        cache.decode(sids, q, k, k)

    def layer():
        reshape_and_cache(k, k, cache.k, cache.v, meta)
        paged_attention(q, cache.k, cache.v, meta, out)

    for name, fn, calls in (
            (f"PagedKVCache.decode, {batch} seqs", cache_step, 500),
            ("PagedMetadata, once a step", lambda: PagedMetadata(*args), 2000),
            ("PagedMetadata, validate=False", lambda: PagedMetadata(*args, validate=False),
             2000),
            ("engine layer: store + attention", layer, 2000)):
        print(f"{name:36s} {_best(fn, calls):7.2f} µs")
    _ = np


if __name__ == "__main__":
    sys.exit(main())
