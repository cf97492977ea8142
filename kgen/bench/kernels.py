"""`make bench-kernels`: the prefill and decode variants timed side by side on the GPU
at hand, as ratios to the q4 baseline.

Every variant runs on the same inputs; rounds interleave the variants and the
median of the rounds is reported, each round timing a burst of launches with
CUDA events. Each launch is bound (contracts checked) once, then replayed
raw, so the times are the kernels', not the Python launcher's. The bit-exact
variants' outputs are compared on the way (a benchmark of a wrong kernel is
worthless). Numbers depend on the GPU: on a K80
they speak to the sm_37 design; on newer GPUs the driver JIT-compiles the
sm_37 PTX and the ratios say little about Kepler.
"""

from __future__ import annotations

import statistics
import sys

import numpy as np

ROUNDS, BURST, WARMUP = 7, 20, 3
PREFILL = ["fc_attn_flash_prefill_q4", "fc_attn_flash_prefill_q4_kr",
           "fc_attn_flash_prefill_q4_kvs", "fc_attn_flash_prefill_q4_kh",
           "fc_attn_flash_prefill_q4_kqh"]
BIT_EXACT = ["fc_attn_flash_prefill_q4_kr", "fc_attn_flash_prefill_q4_kvs"]


def _time(cp, fn, burst: int) -> float:
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(burst):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / burst


def _raw(launches):
    """Replay already-bound launches (kgen.runtime.Launch) without re-binding."""
    from kgen.runtime.launch import module

    calls = [(module(ptx).get_function(b.kernel), b) for ptx, b in launches]

    def run():
        for f, b in calls:
            f(b.grid, b.block, b.args, shared_mem=b.shared_bytes)
    return run


def _bench(cp, arms: dict) -> dict[str, float]:
    arms = {k: _raw(fn()) for k, fn in arms.items()}  # the first call binds and launches
    for fn in arms.values():
        for _ in range(WARMUP):
            fn()
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(ROUNDS):
        for name, fn in arms.items():
            times[name].append(_time(cp, fn, BURST))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    import cupy as cp

    from kgen.runtime.package import ensure_kgen_kernels

    ensure_kgen_kernels()
    import kgen_kernels as kk

    from kgen.runtime.kv import KVCache

    g = np.random.default_rng()
    hk, H, hd = 2, 16, 256  # kv_groups 8, head_dim 256: the reference's shipped shape
    n, pos0, sink, win = 128, 896, 4, 128
    cache = KVCache(hk, hd, pos0 + n, kv="q4", sink=sink, win=win)
    for lo in range(0, pos0 + n, 128):
        rows = g.standard_normal((128, hk, hd), dtype=np.float32)
        cache.append(cp.asarray(rows), cp.asarray(rows * 0.5), pos0=lo)
    q = cp.asarray(g.standard_normal((n, H, hd), dtype=np.float32))
    outs = {k: cp.full((n, H, hd), np.nan, cp.float32) for k in PREFILL}
    shadows = (cache.k_sink, cache.v_sink, cache.k_win, cache.v_win)
    arms = {k: (lambda k=k: [(kk.attn_prefill.PTX, getattr(kk, k)(
        q, cache.k, cache.v, *shadows, outs[k], pos0=pos0, sink=sink, win=win))])
        for k in PREFILL}
    prefill = _bench(cp, arms)
    base = outs[PREFILL[0]].get()
    for k in BIT_EXACT:
        if not np.array_equal(outs[k].get().view(np.uint32), base.view(np.uint32)):
            print(f"bench: {k} is not bit-exact with {PREFILL[0]}", file=sys.stderr)
            return 1

    seq = 4096
    f32 = KVCache(hk, hd, seq, kv="f32")
    q4 = KVCache(hk, hd, seq, kv="q4", sink=sink, win=win)
    for c in (f32, q4):
        for lo in range(0, seq, 256):
            rows = cp.asarray(g.standard_normal((256, hk, hd), dtype=np.float32))
            c.append(rows, rows, pos0=lo)
    q1 = cp.asarray(g.standard_normal((H, hd), dtype=np.float32))
    pos = cp.asarray([seq - 1], cp.int32)
    out1 = cp.empty((H, hd), cp.float32)
    decode = _bench(cp, {
        "decode f32 (host plan)": lambda: _decode(kk, f32, q1, seq, out1),
        "decode q4 (host plan)": lambda: _decode(kk, q4, q1, seq, out1),
        "decode q4 (device pos)": lambda: _decode_dev(kk, q4, q1, pos, out1),
    })

    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    print(f"kernel benchmark on {dev['name'].decode()}: {ROUNDS} interleaved rounds x {BURST} "
          f"launches, medians")
    print(f"prefill: n={n} rows at pos0={pos0}, kv_groups {H // hk}, head_dim {hd}, q4 cache "
          f"(sink {sink}, win {win})")
    for k, t in prefill.items():
        print(f"  {k:<32} {t * 1e3:8.1f} us   {prefill[PREFILL[0]] / t:5.2f}x vs q4")
    print(f"decode: seq_len {seq}, kps 256, splits_cap 16 (split kernel + combine)")
    ref = decode["decode q4 (host plan)"]
    for k, t in decode.items():
        print(f"  {k:<32} {t * 1e3:8.1f} us   {ref / t:5.2f}x vs q4")
    return 0


def _decode(kk, c, q1, seq, out):
    """Split kernel + combine with the host plan."""
    from kgen.runtime.plan import decode_plan

    plan = decode_plan(seq, 256, 16)
    m, l, acc = c.scratch.get(q1.shape[0], plan.n_splits, c.head_dim)
    q4 = c.kv == "q4"
    shadows = (c.k_sink, c.v_sink, c.k_win, c.v_win) if q4 else ()
    extra = {"sink": c.sink, "win": c.win} if q4 else {}
    fn = kk.fc_attn_flash_decode_q4 if q4 else kk.fc_attn_flash_decode
    ptx = kk.attn_decode.PTX
    return [(ptx, fn(q1, c.k, c.v, *shadows, m, l, acc, seq_len=seq, n_splits=plan.n_splits,
                     split_len=plan.split_len, **extra)),
            (ptx, kk.fc_attn_flash_decode_combine(m, l, acc, out, n_splits=plan.n_splits))]


def _decode_dev(kk, c, q1, pos, out):
    """The graph-capturable form: plan recomputed on the device from pos[0]."""
    m, l, acc = c.scratch.get(q1.shape[0], 16, c.head_dim)
    ptx = kk.attn_decode.PTX
    return [(ptx, kk.fc_attn_flash_decode_q4_dev(
                q1, c.k, c.v, c.k_sink, c.v_sink, c.k_win, c.v_win, m, l, acc, pos, kps=256,
                splits_cap=16, sink=c.sink, win=c.win, validate_pos=False)),
            (ptx, kk.fc_attn_flash_decode_combine_dev(m, l, acc, out, pos, kps=256,
                                                      splits_cap=16, validate_pos=False))]


if __name__ == "__main__":
    raise SystemExit(main())
