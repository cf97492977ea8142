"""`make bench-kernels`: the generated kernels timed side by side on the GPU at
hand, correctness checked in the same run.

Tables (printed, and saved as JSON plus PNG charts under $KGEN_BENCH_OUT,
default bench-out/):

* heads    -- for every model head size and KV format, the prefill and decode
              kernels KVCache chooses: time, and decode's cache bandwidth;
* variants -- every prefill variant serving the reference's shape (head_dim 256,
              8 q heads per kv head), as ratios to the kernel KVCache chooses;
* prefill_long -- causal prefill of 8192 rows, every format, head_dim 64, 128 and 256, GQA
              4 and 8: every kernel serving the shape beside torch SDPA (its default
              backend, labelled tensor-core where it is, and the math path, the SIMT f32
              peer every ratio is to) and SGEMM with TF32 off, as % of SGEMM;
* decode_long -- f32 decode at 32k keys (head_dim 256, 8 q heads per kv head) in GB/s
              against a device-to-device copy;
* decode_goals -- split decode + combine at 1k, 4k and 32k keys, every format, head_dim
              128 and 256, GQA 4 and 8: the default plan and the swept best against the
              roofline (the copy timed in each shape's interleaved rounds beside its
              arms, the SGEMM rate in the same run);
* paged_goals -- paged decode (32 sequences x 4k keys), paged varlen prefill and the
              chunked prefill of every format against the roofline (the copy timed with
              each format's arms) and SGEMM;
* prefill_rows -- the query-tile prefill beside the block_tile one for chunks of 1 to 512
              rows after a context, and which of them KVCache picks;
* prefill_split -- a prefill chunk of 1 to 512 rows after a 4k context: the block_tile
              prefill, the query tile whole and its split twin at 2 to 16 splits
              (KGEN_BENCH_PREFILL_SPLITS), the plan's count marked;
* mla_goals -- the MLA decode and prefill at the engine's shapes against their roofline
              and SGEMM;
* launch   -- host cost of one decode step: a raw CuPy launch with prepared
              arguments, the kgen launcher, KVCache.decode, and a CUDA graph.

Each kernel row also carries the kernel's sm_37 occupancy on a K80 SMX at that launch
(blocks and warps resident, from the build's ptxas report: the SASS a K80 runs, not the
image the driver JIT-compiled here), printed as [K80: ...].

Rounds interleave the arms and report medians, each round timing a burst of
launches with CUDA events; kernels are bound once (contracts checked) and then
replayed raw from a CUDA graph of the burst, so kernel times are the kernels', not
the launcher's (launch reports the host's costs). Every timed
kernel's output is compared with the float64 NumPy reference first (a benchmark
of a wrong kernel is worthless). On anything but a K80 the driver JIT-compiles
the sm_37 PTX: absolute times say little about Kepler, ratios more.

A GPU lent a few minutes a command runs it in parts (KGEN_BENCH_ONLY, KGEN_BENCH_KV,
KGEN_BENCH_HEAD_DIMS, each to its own KGEN_BENCH_OUT); `python -m kgen.bench.kernels
report DIR...` then prints and charts their merged kernels.json, no GPU needed.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROUNDS, BURST, WARMUP = 7, 10, 2
HK, H = 2, 16             # kv heads, q heads: 8 q heads per kv head
SEQ, PREFILL_ROWS = 4096, 128
KPS, CAP = 256, 16        # the reference engine's decode plan
# The launch table's plan: a tuned 4k step's size (64 splits), so the step's GPU time
# is what an engine sees after `kgen tune`, not the default plan's few long splits.
LAUNCH_KPS, LAUNCH_CAP = 64, 64
RTOL, ATOL = 2e-4, 2e-5


def _time(cp, fn, burst: int, stream=None) -> float:
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(burst):
        fn()
    stop.record(stream)
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / burst  # ms


def _graphed(cp, fn):
    """(run, stream): a CUDA graph of BURST calls of ``fn`` (a replay arm: kernel launches
    only), captured once, and the stream it launches on. Timed, it gives the kernels'
    time without the host's cost of each launch between them, as an engine replaying its
    captured decode step sees it (a raw launch from Python costs microseconds, more than a
    short decode kernel runs)."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        try:
            for _ in range(BURST):
                fn()
        finally:
            graph = s.end_capture()
    return (lambda: graph.launch(s)), s


def bench(cp, arms: dict) -> dict[str, float]:
    """Median ms per call of each arm, over interleaved rounds: a replay arm as a CUDA
    graph of a burst of its calls (:func:`_graphed`), any other arm as a burst of calls."""
    runs = {name: _graphed(cp, fn) if getattr(fn, "graphable", False) else (fn, None)
            for name, fn in arms.items()}
    for run, _ in runs.values():
        for _ in range(WARMUP):
            run()
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(ROUNDS):
        for name, (run, stream) in runs.items():
            times[name].append(_time(cp, run, BURST) if stream is None else
                               _time(cp, run, 1, stream) / BURST)
    return {k: statistics.median(v) for k, v in times.items()}


def _function(launcher, kernel: str):
    """The CuPy function behind a generated launcher (its fatbin, loaded once)."""
    import cupy as cp

    from kgen.runtime.launch import function

    return function(launcher.fatbin, kernel, cp.cuda.runtime.getDevice())


def replay(bound: list[tuple]) -> callable:
    """Replay (launcher, Launch) pairs raw: no binding, no checks."""
    calls = [(_function(fn, b.kernel), b) for fn, b in bound]

    def run():
        for f, b in calls:
            f(b.grid, b.block, b.args, shared_mem=b.shared_bytes)
    run.graphable = True  # kernel launches only: bench() times it as a CUDA graph
    return run


# ---- inputs --------------------------------------------------------------------------

def _shadows(fmt) -> tuple[int, int]:
    return (4, 128) if fmt.shadows else (0, 0)


def filled_cache(cp, g, kv: str, hd: int, seq: int = SEQ, variants=None, n_kv: int = HK):
    """A KVCache of ``n_kv`` heads holding ``seq`` positions and its host mirror
    (kgen.numpy_ref)."""
    from kgen import numpy_ref as ref
    from kgen.formats import FORMATS
    from kgen.runtime.kv import KVCache

    sink, win = _shadows(FORMATS[kv])
    cache = KVCache(n_kv, hd, seq, kv=kv, sink=sink, win=win, variants=variants)
    host = ref.HostCache.empty(cache.fmt, n_kv, seq, hd, cache.RING_ROWS, cache.SINK_ROWS)
    step = cache.RING_ROWS or 1024
    for lo in range(0, seq, step):
        n = min(step, seq - lo)
        kx = g.standard_normal((n, n_kv, hd), dtype=np.float32)
        vx = g.standard_normal((n, n_kv, hd), dtype=np.float32)
        cache.append(cp.asarray(kx), cp.asarray(vx), pos0=lo)
        ref.append(kx, vx, host, lo, sink, win)
    return cache, host


def decode_inputs(cp, g, kv: str, hd: int, n_head: int, n_kv: int, seq: int):
    """(cache, q1, want): a cache of ``seq`` positions (filled_cache), one decode query of
    ``n_head`` heads at its last position, and the float64 reference of the decode there
    (a goal shape of decode_goals and of kgen.bench.counters)."""
    from kgen import numpy_ref as ref
    from kgen.formats import FORMATS

    sink, win = _shadows(FORMATS[kv])
    cache, host = filled_cache(cp, g, kv, hd, seq, n_kv=n_kv)
    kr, vr = ref.read_kv_rows(host, seq - 1, sink, win)
    q1 = cp.asarray(g.standard_normal((n_head, hd), dtype=np.float32))
    want = ref.decode_attention(q1.get(), kr, vr, n_head // n_kv, seq, 256, 16, 0, 0,
                                1 / math.sqrt(hd))
    return cache, q1, want


def _check(name: str, got, want, rtol=RTOL, atol=ATOL) -> None:
    got = np.asarray(got, dtype=np.float64)
    if np.isnan(got).any() or not np.allclose(got, want, rtol=rtol, atol=atol):
        err = float(np.nanmax(np.abs(got - want)))
        raise SystemExit(f"bench: {name} differs from the NumPy reference (max |err| {err:.3g}); "
                         "not timing a wrong kernel")


# ---- heads ---------------------------------------------------------------------------

def prefill_arm(cp, cache, q, kernel=None):
    """(arm, out, kernel): the prefill of the last PREFILL_ROWS rows, bound once: the
    cache's choice for a batch of q's rows and its launches (KVCache._attend: the whole
    kernel, or its split twin and the combine), unless ``kernel`` is given (whole)."""
    from kgen.runtime.calls import Calls

    G = q.shape[1] // cache.n_head_kv
    out = cp.full(q.shape, np.nan, cp.float32)
    if kernel is not None:
        k, fn = kernel
        b = fn(q, cache.k, cache.v, *cache.shadows, out, pos0=SEQ - PREFILL_ROWS,
               **cache._shadow_args)
        return replay([(fn, b)]), out, k
    kp, fn = cache.kernels.get("prefill", G, rows=q.shape[0])
    calls = Calls()
    k, _ = cache._attend(calls, q, out, SEQ - PREFILL_ROWS, kp, fn,
                         cache._options(q.shape[1]))
    return replay(calls.run()), out, k


def prefill_reference(cache, host, q, k, rows: int = 4):
    """The reference for the last ``rows`` query rows of the prefill."""
    from kgen import numpy_ref as ref

    sink, win = cache.sink, cache.win
    pos0 = SEQ - PREFILL_ROWS
    floor = (ref.prefill_live_floor(pos0, PREFILL_ROWS, cache.RING_ROWS)
             if k.ring_floor.value == "batch" else None)
    k_round = ((lambda x: x.astype(np.float16).astype(np.float32))
               if k.k_stage.value == "shared_f16" else None)
    qq = q[-rows:]
    if k.q_stage.value == "f16":
        qq = qq.astype(np.float16).astype(np.float32)
    return ref.prefill_attention_cache(qq, host, q.shape[1] // cache.n_head_kv, SEQ - rows,
                                       sink, win, 0, 0, 1 / math.sqrt(q.shape[-1]), floor,
                                       tile=k.tile_keys, k_round=k_round)


def decode_arm(cp, cache, q1):
    """(arm, out, kernel): split decode over SEQ keys + combine, host plan, bound once."""
    from kgen.runtime.plan import decode_plan

    G = q1.shape[0] // cache.n_head_kv
    kd, fdec = cache.kernels.get("decode", G)
    _, fcomb = cache.kernels.get("combine")
    plan = decode_plan(SEQ, KPS, CAP, kd.tile_keys)
    m, l, acc = cache.scratch.get(q1.shape[0], plan.n_splits, cache.head_dim)
    out = cp.full(q1.shape, np.nan, cp.float32)
    b1 = fdec(q1, cache.k, cache.v, *cache.shadows, m, l, acc, seq_len=SEQ,
              n_splits=plan.n_splits, split_len=plan.split_len, **cache._shadow_args)
    b2 = fcomb(m, l, acc, out, n_splits=plan.n_splits)
    return replay([(fdec, b1), (fcomb, b2)]), out, kd


def heads_table(cp, g) -> list[dict]:
    from kgen import numpy_ref as ref
    from kgen.formats import FORMATS
    from kgen.testing.testgen import MODEL_HEAD_DIMS

    rows = []
    for hd in MODEL_HEAD_DIMS:
        for kv, fmt in FORMATS.items():
            if not fmt.accepts_head_dim(hd):
                continue
            cache, host = filled_cache(cp, g, kv, hd)
            q = cp.asarray(g.standard_normal((PREFILL_ROWS, H, hd), dtype=np.float32))
            q1 = cp.asarray(g.standard_normal((H, hd), dtype=np.float32))
            pre, out, kp = prefill_arm(cp, cache, q)
            dec, out1, kd = decode_arm(cp, cache, q1)
            pre(), dec()
            cp.cuda.runtime.deviceSynchronize()
            _check(f"{kp.name} hd{hd}", out.get()[-4:], prefill_reference(cache, host,
                                                                       q.get(), kp))
            kr, vr = ref.read_kv_rows(host, SEQ - 1, cache.sink, cache.win)
            want = ref.decode_attention(q1.get(), kr, vr, H // HK, SEQ, KPS, CAP, 0, 0,
                                        1 / math.sqrt(hd), tile=kd.tile_keys)
            _check(f"{kd.name} hd{hd}", out1.get(), want)
            t = bench(cp, {"prefill": pre, "decode": dec})
            cache_bytes = 2 * HK * SEQ * fmt.row_bytes(hd)
            rows.append({"head_dim": hd, "kv": kv, "prefill_kernel": kp.name,
                         "decode_kernel": kd.name, "prefill_us": t["prefill"] * 1e3,
                         "decode_us": t["decode"] * 1e3,
                         "decode_GBps": cache_bytes / (t["decode"] * 1e-3) / 1e9})
            del cache, host
    return rows


# ---- prefill variants at the reference shape ------------------------------------------

def variants_table(cp, g) -> list[dict]:
    from kgen.formats import FORMATS
    from kgen.runtime.bind import shape_refusal
    from kgen.runtime.roles import ROLES
    from kgen.runtime.select import generated, options

    hd, out_rows = 256, []
    prefill = ROLES["prefill"]  # a KVCache's prefill: its op, mode and position
    for kv in FORMATS:
        cache, host = filled_cache(cp, g, kv, hd)
        q = cp.asarray(g.standard_normal((PREFILL_ROWS, H, hd), dtype=np.float32))
        chosen = cache.kernels.get("prefill", H // HK, rows=PREFILL_ROWS)[0].name
        same = [(k, f) for k, f in generated() if k.op is prefill.op and k.mode is prefill.mode
                and k.kv.value == kv and shape_refusal(k, hd, H // HK) is None
                and options(k) == 0 and k.position is prefill.position
                and (not cache.fmt.shadows or (k.ring_rows, k.sink_rows) ==
                     (cache.RING_ROWS, cache.SINK_ROWS))]
        arms = {}
        for k, f in same:
            arm, out, _ = prefill_arm(cp, cache, q, (k, f))
            arm()
            cp.cuda.runtime.deviceSynchronize()
            lossy = k.k_stage.value == "shared_f16" or k.q_stage.value == "f16"
            _check(f"{k.name}", out.get()[-4:], prefill_reference(cache, host, q.get(), k),
                   *((2e-2, 2e-3) if lossy else (RTOL, ATOL)))
            arms[k.name] = arm
        t = bench(cp, arms)
        for name, ms in t.items():
            out_rows.append({"kv": kv, "kernel": name, "us": ms * 1e3,
                             "ratio": t[chosen] / ms, "chosen": name == chosen})
    return out_rows


# ---- long prefill against PyTorch SDPA -------------------------------------------------

LONG_N = 8192
# (q heads, kv heads) of the long prefill: GQA 8 (the reference's 16/2) and GQA 4 (32/8).
LONG_SHAPES = tuple(tuple(int(x) for x in hs.split("/")) for hs in
                    os.environ.get("KGEN_BENCH_LONG_SHAPES", "16/2,32/8").split(",") if hs)


SGEMM_N = 8192
SGEMM_ARM = f"cuBLAS SGEMM {SGEMM_N}^2 (TF32 off)"


def _sgemm(cp):
    """An arm multiplying two SGEMM_N x SGEMM_N f32 matrices (torch.matmul with TF32
    off, else CuPy's cuBLAS, TF32 off by default), checked on a few entries first."""
    g = np.random.default_rng(1)
    a_np = g.standard_normal((SGEMM_N, SGEMM_N), dtype=np.float32)
    b_np = g.standard_normal((SGEMM_N, SGEMM_N), dtype=np.float32)
    want = a_np[:2].astype(np.float64) @ b_np.astype(np.float64)
    try:
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False
        a, b = torch.as_tensor(a_np, device="cuda"), torch.as_tensor(b_np, device="cuda")
        holder = {}

        def run():
            holder["c"] = torch.matmul(a, b)
        run()
        torch.cuda.synchronize()
        got = holder["c"][:2].cpu().numpy()
    except ImportError:
        a, b = cp.asarray(a_np), cp.asarray(b_np)
        holder = {}

        def run():
            holder["c"] = a @ b
        run()
        got = holder["c"][:2].get()
    _check(SGEMM_ARM, got, want, 1e-3, 1e-2)
    return run


SIMT_LABEL = "(SIMT f32)"  # the label of the SDPA arm that is prefill_long's bar


def _sdpa(q_np, k_np, v_np, G):
    """torch's scaled_dot_product_attention (f32, causal, GQA by repeat) on the same
    data: {label: arm} for the backend torch picks by default (labelled with it:
    flash and memory-efficient run f32 on tensor cores on sm80+) and the math path
    (matmul with TF32 off, softmax: the SIMT f32 peer), plus a reader of each arm's
    output; empty when torch is not importable."""
    try:
        import torch
    except ImportError:
        return {}
    torch.backends.cuda.matmul.allow_tf32 = False
    q = torch.as_tensor(q_np, device="cuda").transpose(0, 1)[None]       # [1][H][N][hd]
    k = torch.as_tensor(k_np, device="cuda").repeat_interleave(G, 1).transpose(0, 1)[None]
    v = torch.as_tensor(v_np, device="cuda").repeat_interleave(G, 1).transpose(0, 1)[None]
    f = torch.nn.functional.scaled_dot_product_attention
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        SDPBackend = sdpa_kernel = None
    picked = "default"
    try:  # the backend the dispatcher picks for these inputs
        choice = torch._fused_sdp_choice(q, k, v, is_causal=True)
        picked = SDPBackend(choice).name.lower() if SDPBackend is not None else str(choice)
    except Exception:  # noqa: BLE001 -- a private API: the label stays "default"
        pass
    core = {"flash_attention": "tensor-core", "efficient_attention": "tensor-core",
            "cudnn_attention": "tensor-core", "math": SIMT_LABEL[1:-1]}.get(picked, "?")
    arms = {}

    def arm(backend):
        holder = {}

        def run():
            if backend is None:
                holder["out"] = f(q, k, v, is_causal=True)
            else:
                with sdpa_kernel(backend):
                    holder["out"] = f(q, k, v, is_causal=True)
        run()
        torch.cuda.synchronize()
        return run, lambda: holder["out"][0].transpose(0, 1)[-2:].cpu().numpy()

    arms[f"torch SDPA f32 {picked} ({core})"] = arm(None)
    if sdpa_kernel is not None and picked != "math":
        arms[f"torch SDPA f32 math {SIMT_LABEL}"] = arm(SDPBackend.MATH)
    return arms


def _bench_head_dims() -> tuple[int, ...]:
    """prefill_long's head_dims: KGEN_BENCH_HEAD_DIMS (comma-separated), else 64, 128, 256."""
    return tuple(int(x) for x in os.environ.get("KGEN_BENCH_HEAD_DIMS", "64,128,256").split(",")
                 if x)


def causal_tflops(n: int, hd: int, n_head: int, ms: float) -> float:
    """TFLOP/s of a causal prefill of n rows from position 0: 2 * n^2 * hd * n_head FLOPs
    (q.K and P.V, half the square each)."""
    return 2.0 * n * n * hd * n_head / (ms * 1e-3) / 1e12


def long_prefill_inputs(cp, g, H: int, HK: int, kv: str, hd: int):
    """(cache, q, kx, vx, want): a cache of ``kv`` rows holding LONG_N random positions
    (kx, vx appended from 0), LONG_N query rows of ``H`` heads, and the float64 reference
    of the causal prefill's last two rows (a goal shape of prefill_long and of
    kgen.bench.counters)."""
    from kgen import numpy_ref as ref
    from kgen.runtime.kv import KVCache

    cache = KVCache(HK, hd, LONG_N, kv=kv)
    kx = g.standard_normal((LONG_N, HK, hd), dtype=np.float32)
    vx = g.standard_normal((LONG_N, HK, hd), dtype=np.float32)
    cache.append(cp.asarray(kx), cp.asarray(vx), pos0=0)
    host = ref.HostCache.empty(cache.fmt, HK, LONG_N, hd, cache.RING_ROWS, cache.SINK_ROWS)
    ref.append(kx, vx, host, 0)
    q = g.standard_normal((LONG_N, H, hd), dtype=np.float32)
    want = ref.prefill_attention_cache(q[-2:], host, H // HK, LONG_N - 2, 0, 0, 0, 0,
                                       1 / math.sqrt(hd))
    return cache, q, kx, vx, want


def prefill_long_table(cp, g) -> list[dict]:
    """Causal prefill of LONG_N rows from position 0 (every format -- KGEN_BENCH_KV --,
    head_dim 64, 128 and 256 -- KGEN_BENCH_HEAD_DIMS --, 16/2 and 32/8 q/kv heads --
    KGEN_BENCH_LONG_SHAPES --): every
    causal prefill kernel serving the shape (the query_tile ones among them; a regex
    KGEN_BENCH_MATCH keeps only the kernels it finds in the name), torch SDPA (its
    default backend, and the math path) and an SGEMM timed beside them, so each arm
    reports TFLOP/s and its fraction of the SGEMM's."""
    from kgen import numpy_ref as ref
    from kgen.ir.geometry import key_partials
    from kgen.runtime.bind import shape_refusal
    from kgen.runtime.roles import ROLES
    from kgen.runtime.select import generated

    prefill = ROLES["prefill"]  # a KVCache's prefill: its op, mode and position
    match = os.environ.get("KGEN_BENCH_MATCH")
    sgemm = _sgemm(cp)
    sgemm_flops = 2.0 * SGEMM_N ** 3
    rows = []
    for (H, HK), kv, hd in itertools.product(LONG_SHAPES, _goal_kvs(), _bench_head_dims()):
        cache, q, kx, vx, want = long_prefill_inputs(cp, g, H, HK, kv, hd)
        qd = cp.asarray(q)
        arms, built = {}, {}
        for k, fn in generated():
            if not (k.op is prefill.op and k.mode is prefill.mode and k.kv.value == kv and
                    k.v_kv.value == kv and k.position is prefill.position
                    and shape_refusal(k, hd, H // HK) is None
                    and k.window.value == "sink_recent" and k.sinks.value == "none"
                    and k.mask.value == "causal"):
                continue
            if match and not re.search(match, k.name):
                continue
            if key_partials(k):  # a split twin writes partials (prefill_split runs them)
                continue
            if cache.fmt.shadows and (k.ring_rows, k.sink_rows) != (cache.RING_ROWS,
                                                                    cache.SINK_ROWS):
                continue
            out = cp.full(qd.shape, np.nan, cp.float32)
            b = fn(qd, cache.k, cache.v, *cache.shadows, out, pos0=0,
                   **cache._shadow_args)
            cp.cuda.runtime.deviceSynchronize()
            lossy = k.k_stage.value == "shared_f16" or k.q_stage.value == "f16"
            _check(k.name, out.get()[-2:], want, *((2e-2, 2e-3) if lossy else (RTOL, ATOL)))
            arms[k.name] = replay([(fn, b)])
            built[k.name] = k
        # SDPA in f32 on the same shapes (the unquantized rows), each checked first.
        peers = set()
        sd = _sdpa(q, kx, vx, H // HK)
        if sd:
            dense = ref.prefill_attention(q[-2:], np.ascontiguousarray(kx.swapaxes(0, 1)),
                                          np.ascontiguousarray(vx.swapaxes(0, 1)),
                                          H // HK, LONG_N - 2, 0, 0, 1 / math.sqrt(hd))
            for label, (run, read) in sd.items():
                _check(label, read(), dense, 1e-3, 1e-4)
                arms[label] = run
                peers.add(label)
        arms[SGEMM_ARM] = sgemm
        t = bench_slow(cp, arms)
        sgemm_tf = sgemm_flops / (t[SGEMM_ARM] * 1e-3) / 1e12
        ours = [(v, n) for n, v in t.items() if n not in peers and n != SGEMM_ARM]
        best = min(ours)[1] if ours else None
        for name, ms in t.items():
            tf = sgemm_tf if name == SGEMM_ARM else causal_tflops(LONG_N, hd, H, ms)
            rows.append({"kv": kv, "head_dim": hd, "n_head": H, "n_kv": HK,
                         "kernel": name, "ms": ms,
                         "TFLOPs": tf, "of_sgemm": tf / sgemm_tf,
                         "peer": name in peers, "sgemm": name == SGEMM_ARM,
                         "best_kgen": name == best,
                         **({"k80": k80(built[name], hd, H // HK)} if name in built else {})})
        del cache
    return rows


def bench_slow(cp, arms: dict) -> dict[str, float]:
    """bench() for arms of milliseconds: fewer rounds and launches."""
    times: dict[str, list[float]] = {k: [] for k in arms}
    for fn in arms.values():
        fn()
    for _ in range(3):
        for name, fn in arms.items():
            times[name].append(_time(cp, fn, 2))
    return {k: statistics.median(v) for k, v in times.items()}


def _blocks_per_sm(cp, fn, b) -> int:
    """How many blocks of launch ``b`` one SM of this device holds at once (the driver's
    occupancy of the kernel's JIT-compiled image)."""
    import ctypes

    f = _function(fn, b.kernel)
    n = ctypes.c_int(0)
    r = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(n), ctypes.c_void_p(getattr(f, "kernel", f).ptr),
        ctypes.c_int(int(np.prod(b.block))), ctypes.c_size_t(int(b.shared_bytes)))
    return n.value if r == 0 else -1


_RESOURCES: dict[str, dict[str, dict]] = {}  # generated tree -> kernel -> ptxas's report


def k80(k, head_dim: int, groups: int) -> dict:
    """The kernel's sm_37 occupancy on one K80 SMX (GK210) for a launch at ``head_dim``
    and ``groups``, from the build's ptxas report (the manifest's resources; the sm_37
    SASS the K80 runs, not the JIT image timed here): {"blocks", "warps"} resident."""
    import kgen_kernels

    from kgen.compiler.coverage import occupancy
    from kgen.runtime import manifest

    root = str(kgen_kernels.ROOT)
    if root not in _RESOURCES:
        _RESOURCES[root] = {n: e.resources for n, e in manifest.read(Path(root)).kernels.items()}
    occ = occupancy(k, _RESOURCES[root][k.name], [head_dim], groups)[str(head_dim)]
    return {"blocks": occ["blocks_per_sm"], "warps": occ["warps_per_sm"]}


def split_arm(cp, cache, fn, fcomb, q1, seq: int, kps: int, cap: int, tile: int):
    """(split kernel launch, combine launch, out, plan): a host-plan split decode of q1
    over ``seq`` keys of ``cache``, its partials and output NaN-poisoned, bound once."""
    from kgen.runtime.plan import decode_plan

    n_head, hd = q1.shape
    plan = decode_plan(seq, kps, cap, tile)
    m = cp.full(n_head * plan.n_splits, np.nan, cp.float32)
    l = cp.full(n_head * plan.n_splits, np.nan, cp.float32)  # noqa: E741
    acc = cp.full(n_head * plan.n_splits * hd, np.nan, cp.float32)
    out = cp.full((n_head, hd), np.nan, cp.float32)
    b1 = fn(q1, cache.k, cache.v, *cache.shadows, m, l, acc, seq_len=seq,
            n_splits=plan.n_splits, split_len=plan.split_len, **cache._shadow_args)
    b2 = fcomb(m, l, acc, out, n_splits=plan.n_splits)
    return b1, b2, out, plan


# ---- decode bandwidth at a long context --------------------------------------------

def decode_long_table(cp, g) -> list[dict]:
    """f32 decode at 32k keys (head_dim 256, 8 q heads per kv head): KVCache's default
    kernel and every warp_stream decode kernel that serves the shape, under several
    plans, as GB/s of cache read against a device-to-device copy measured beside it.
    The warp_stream kernels run once more with one q head per kv head (the same bytes,
    an eighth of the arithmetic), which shows what GQA's arithmetic costs them."""
    from kgen import numpy_ref as ref
    from kgen.ir.axes import Schedule
    from kgen.runtime.bind import shape_refusal
    from kgen.runtime.roles import ROLES
    from kgen.runtime.select import generated

    hd, seq = 256, 32768
    cache, host = filled_cache(cp, g, "f32", hd, seq)
    kr, vr = ref.read_kv_rows(host, seq - 1)
    kd, fdec = cache.kernels.get("decode", H // HK)
    _, fcomb = cache.kernels.get("combine")
    role = replace(ROLES["decode"], kv="f32")  # a KVCache's decode over f32 rows
    stream = [(k, f) for k, f in generated() if role.matches(k)
              and k.schedule is Schedule.WARP_STREAM and shape_refusal(k, hd, H // HK) is None]
    runs = [(kd, fdec, H // HK, ((256, 16), (128, 64), (64, 256), (128, 256)))]
    runs += [(k, f, H // HK, ((128, 256), (256, 128), (512, 64))) for k, f in stream]
    runs += [(k, f, 1, ((256, 128), (512, 64))) for k, f in stream]
    arms = {}
    for k, fn, groups, plans in runs:
        n_head = HK * groups
        q1 = cp.asarray(g.standard_normal((n_head, hd), dtype=np.float32))
        for kps, cap in plans:
            b1, b2, out, plan = split_arm(cp, cache, fn, fcomb, q1, seq, kps, cap, k.tile_keys)
            want = ref.decode_attention(q1.get(), kr, vr, groups, seq, kps, cap, 0, 0,
                                        1 / math.sqrt(hd), tile=k.tile_keys)
            gqa = "" if groups == H // HK else f" [{groups} q head per kv head]"
            name = f"{k.name} kps {kps} cap {cap} ({plan.n_splits} splits){gqa}"
            _check(name, out.get(), want)
            arms[name] = replay([(fn, b1), (fcomb, b2)])
            arms[name + " split only"] = replay([(fn, b1)])
    copy = "device-to-device copy (256 MiB)"
    arms[copy], moved = _copy(cp)
    t = bench(cp, arms)
    cache_bytes = 2 * HK * seq * hd * 4
    copy_gbps = moved / (t[copy] * 1e-3) / 1e9
    rows = [{"arm": copy, "GBps": copy_gbps, "us": t[copy] * 1e3}]
    for name, ms in t.items():
        if name != copy:
            gbps = cache_bytes / (ms * 1e-3) / 1e9
            rows.append({"arm": name, "us": ms * 1e3, "GBps": gbps,
                         "of_copy": gbps / copy_gbps})
    return rows


# ---- decode against the roofline ---------------------------------------------------

# (q heads, kv heads): GQA 4 and 8; KGEN_BENCH_DECODE_SHAPES (e.g. "32/32,16/8") times
# decode_goals at other group counts (a multi-head model's one: the 1-group quads form
# against the 4-group one it replaced, as arms of one shape).
GOAL_SHAPES = tuple(tuple(int(x) for x in s.split("/")) for s in os.environ.get(
    "KGEN_BENCH_DECODE_SHAPES", "32/8,16/2").split(",") if s)
GOAL_SEQS = tuple(int(x) for x in os.environ.get("KGEN_BENCH_SEQS", "1024,4096,32768").split(",")
                  if x)
GOAL_SPLITS = tuple(int(x) for x in os.environ.get(
    "KGEN_BENCH_SPLITS", "1,2,4,8,16,32,64,128,256,512").split(",") if x)


def _goal_kvs() -> tuple[str, ...]:
    """The formats of the goal tables (prefill_long, decode_goals, paged_goals):
    KGEN_BENCH_KV (comma-separated, e.g. f32), else every registered format."""
    from kgen.formats import FORMATS

    got = os.environ.get("KGEN_BENCH_KV")
    return tuple(filter(None, got.split(","))) if got else tuple(FORMATS)


COPY_ARM = "device-to-device copy"


def _copy(cp) -> tuple[callable, int]:
    """(an arm copying 256 MB device to device, the bytes it moves: read and written)."""
    src = cp.empty(256 * 2**20 // 4, cp.float32)
    dst = cp.empty_like(src)
    return (lambda: cp.copyto(dst, src)), 2 * src.nbytes


def _limits(cp, sgemm, copy) -> tuple[float, float]:
    """(copy GB/s, SGEMM TFLOP/s), timed in interleaved rounds now (``copy``: _copy's
    pair)."""
    run, moved = copy
    t = bench_slow(cp, {COPY_ARM: run, SGEMM_ARM: sgemm})
    return (moved / (t[COPY_ARM] * 1e-3) / 1e9,
            2.0 * SGEMM_N ** 3 / (t[SGEMM_ARM] * 1e-3) / 1e12)


def _with_copy(cp, arms: dict, copy) -> tuple[dict[str, float], float]:
    """bench() of ``arms`` with the copy (``_copy``'s pair) interleaved in the same
    rounds: (the arms' times, the copy's GB/s in those rounds). A roofline from a copy
    timed apart, minutes earlier, moves with the clocks of that moment (3.2 against 3.9
    TB/s at the start and end of one run on the H200)."""
    run, moved = copy
    t = bench(cp, {**arms, COPY_ARM: run})
    return t, moved / (t.pop(COPY_ARM) * 1e-3) / 1e9


def _decode_head_dims() -> tuple[int, ...]:
    """decode_goals' head_dims: KGEN_BENCH_HEAD_DIMS where given (e.g. 96: the head_dim-96
    quads forms against the tiled decode they replaced), else the goals' 128 and 256."""
    return _bench_head_dims() if os.environ.get("KGEN_BENCH_HEAD_DIMS") else (128, 256)


def decode_goals_table(cp, g) -> list[dict]:
    """Split decode + combine against its roofline, for every format (KGEN_BENCH_KV),
    head_dim 128 and 256 (KGEN_BENCH_HEAD_DIMS), GQA 4 and 8 (KGEN_BENCH_DECODE_SHAPES),
    1k/4k/32k keys (KGEN_BENCH_SEQS): the
    kernel KVCache chooses under the plan it uses with an empty tune store, and every
    kernel serving the shape (warp_stream and tiled) under a sweep of split counts.
    roofline = max(cache bytes / copy rate, 4 hd H keys / SGEMM rate), both limits
    timed in this run; a row per (shape, arm) with its fraction of the roofline."""
    from kgen.formats import FORMATS
    from kgen.ir.axes import Schedule
    from kgen.runtime.bind import shape_refusal
    from kgen.runtime.planner import kernel_plan
    from kgen.runtime.roles import ROLES
    from kgen.runtime.select import generated

    match = os.environ.get("KGEN_BENCH_MATCH")
    sgemm = _sgemm(cp)
    copy = _copy(cp)
    copy_gbps, sgemm_tf = _limits(cp, sgemm, copy)
    sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["multiProcessorCount"]
    rows = [{"arm": "limits", "copy_GBps": copy_gbps, "sgemm_TFLOPs": sgemm_tf, "sms": sms}]
    hds = _decode_head_dims()
    for kv in _goal_kvs():
        fmt = FORMATS[kv]
        for hd in hds:
            if not fmt.accepts_head_dim(hd):
                continue
            for n_head, n_kv in GOAL_SHAPES:
                G = n_head // n_kv
                for seq in GOAL_SEQS:
                    cache, q1, want = decode_inputs(cp, g, kv, hd, n_head, n_kv, seq)
                    chosen, _ = cache.kernels.get("decode", G)
                    _, fcomb = cache.kernels.get("combine")
                    role = replace(ROLES["decode"], kv=kv)
                    pool = [(k, f) for k, f in generated() if role.matches(k)
                            and shape_refusal(k, hd, G) is None and k.window.value ==
                            "sink_recent" and k.sinks.value == "none"
                            and k.softcap.value == "none"
                            and (not fmt.shadows or (k.ring_rows, k.sink_rows) ==
                                 (cache.RING_ROWS, cache.SINK_ROWS))]
                    if match:
                        pool = [(k, f) for k, f in pool if k.name == chosen.name
                                or re.search(match, k.name)]
                    dkps, dcap = kernel_plan(chosen, hd, n_kv)
                    arms, meta, occ = {}, {}, {}
                    for k, fn in pool:
                        plans = [(max(1, -(-seq // n)), n) for n in GOAL_SPLITS
                                 if n <= max(1, seq // k.tile_keys)]
                        if k.name == chosen.name:
                            plans.append((dkps, dcap))
                        for kps, cap in plans:
                            b1, b2, out, plan = split_arm(cp, cache, fn, fcomb, q1, seq, kps,
                                                          cap, k.tile_keys)
                            name = f"{k.name} kps {kps} cap {cap} ({plan.n_splits} splits)"
                            if (kps, cap) == (dkps, dcap) and k.name == chosen.name:
                                name += " [default]"
                            cp.cuda.runtime.deviceSynchronize()
                            lossy = k.q_stage.value == "f16" or k.k_stage.value == "shared_f16"
                            _check(f"{name} {kv} hd{hd} {n_head}/{n_kv} {seq}", out.get(),
                                   want, *((2e-2, 2e-3) if lossy else (RTOL, ATOL)))
                            arms[name] = replay([(fn, b1), (fcomb, b2)])
                            meta[name] = (k, plan)
                            occ.setdefault(k.name, _blocks_per_sm(cp, fn, b1))
                    t, copy_now = _with_copy(cp, arms, copy)
                    cache_bytes = 2 * n_kv * seq * fmt.row_bytes(hd)
                    roof_us = max(cache_bytes / (copy_now * 1e9),
                                  4.0 * hd * n_head * seq / (sgemm_tf * 1e12)) * 1e6
                    best = min(t.values())
                    dflt = next(ms for n, ms in t.items() if n.endswith("[default]"))
                    own = min(ms for n, ms in t.items() if meta[n][0].name == chosen.name)
                    print(f"decode_goals {kv} hd{hd} {n_head}/{n_kv} {seq}: roof {roof_us:.1f} "
                          f"us (copy {copy_now:.0f} GB/s); best {best * 1e3:.1f} us = "
                          f"{roof_us / (best * 1e3):.2f} "
                          f"({min(t, key=t.get)}); default {dflt * 1e3:.1f} us = "
                          f"{roof_us / (dflt * 1e3):.2f}; default kernel's best plan "
                          f"{own * 1e3:.1f} us; {occ[chosen.name]} blocks/SM", flush=True)
                    for name, ms in t.items():
                        k, plan = meta[name]
                        rows.append({"kv": kv, "head_dim": hd, "n_head": n_head, "n_kv": n_kv,
                                     "seq": seq, "arm": name, "kernel": k.name,
                                     "stream": k.schedule is Schedule.WARP_STREAM,
                                     "splits": plan.n_splits, "us": ms * 1e3,
                                     "blocks_per_sm": occ[k.name], "k80": k80(k, hd, G),
                                     "roofline_us": roof_us, "of_roofline": roof_us / (ms * 1e3),
                                     "copy_GBps": copy_now,
                                     "default": name.endswith("[default]"),
                                     "best": ms == best, "vs_best": ms / best})
                    del cache
    copy2, sgemm2 = _limits(cp, sgemm, copy)
    rows.append({"arm": "limits (end)", "copy_GBps": copy2, "sgemm_TFLOPs": sgemm2, "sms": sms})
    return rows


# ---- paged decode, chunked and paged prefill against the limits ----------------------

PAGED_SEQS, PAGED_KEYS = 32, 4096        # the paged decode goal: 32 sequences x 4k keys
PAGED_SHAPE = (128, 32, 8)               # head_dim, q heads, kv heads
PAGED_BLOCK = 16
VARLEN = (8, 512)                        # the paged prefill: 8 requests x 512 new rows


def _paged_filled(cp, g, kv: str, rows: list[int]):
    """A PagedKVCache (scattered blocks) holding ``rows[i]`` positions of sequence i and
    its NumPy mirror (kgen.numpy_ref.paged)."""
    from kgen.formats import FORMATS
    from kgen.numpy_ref import paged as pref
    from kgen.runtime.paged import PagedKVCache

    hd, _, n_kv = PAGED_SHAPE
    fmt = FORMATS[kv]
    scales = {"k_scale": 0.5, "v_scale": 0.25} if fmt.tensor_scales else {}
    blocks = sum(-(-r // PAGED_BLOCK) for r in rows) + 1
    cache = PagedKVCache(blocks, PAGED_BLOCK, n_kv, hd, kv=kv, **scales)
    cache.free_blocks = list(g.permutation(blocks).tolist())
    host = pref.PagedCache.empty(kv, blocks, PAGED_BLOCK, n_kv, hd, **scales)
    sids = [cache.add() for _ in rows]
    kx = g.standard_normal((sum(rows), n_kv, hd), dtype=np.float32)
    vx = g.standard_normal((sum(rows), n_kv, hd), dtype=np.float32)
    cache.append(sids, cp.asarray(kx), cp.asarray(vx), rows)
    slots = np.concatenate([cache.slot_mapping(s, range(r)) for s, r in zip(sids, rows,
                                                                            strict=True)])
    host.store(kx, vx, slots)
    return cache, host, sids


def _seq_rows(cache, host, sid: int, n: int):
    from kgen import numpy_ref as ref
    from kgen.numpy_ref import paged as pref

    dense = pref.dense(host, cache.block_table([sid])[0], n)
    return dense, ref.read_kv_rows(dense, n - 1)


PAGED_CAPS = (16, 32, 64)  # split caps the paged decode is also timed at, beside the default


def paged_decode_arms(cp, g, kv: str) -> list[tuple]:
    """[(name, arm, roofline bytes, kernel)]: PagedKVCache's decode of PAGED_SEQS
    sequences at PAGED_KEYS keys with its default kernel, under its default plan and
    under the caps PAGED_CAPS (kps kept), split + combine bound once each, every
    output checked against the float64 reference of three sequences."""
    from kgen import numpy_ref as ref
    from kgen.runtime.options import Options

    hd, n_head, n_kv = PAGED_SHAPE
    G = n_head // n_kv
    cache, host, sids = _paged_filled(cp, g, kv, [PAGED_KEYS] * PAGED_SEQS)
    R = len(sids)
    opts = Options.checked(n_head, 0, 0, None, None, 0.0, None, True)
    kd, fdec, kc, fcomb, dkps, dcap = cache._decode_kernels(G, opts, None, None, R)
    q = cp.asarray(g.standard_normal((R, n_head, hd), dtype=np.float32))
    qh = q.get()
    table = cp.asarray(cache.block_table(sids))
    lens = cp.asarray(np.full(R, PAGED_KEYS, np.int32))
    nbytes = 2 * R * PAGED_KEYS * n_kv * cache.fmt.row_bytes(hd)
    arms = []
    for kps, cap in [(dkps, dcap)] + [(dkps, c) for c in PAGED_CAPS if c != dcap]:
        width = min(max(-(-PAGED_KEYS // kps), 1), cap)
        m = cp.full(R * n_head * width, np.nan, cp.float32)
        l = cp.full(R * n_head * width, np.nan, cp.float32)  # noqa: E741
        acc = cp.full(R * n_head * width * hd, np.nan, cp.float32)
        out = cp.full((R * n_head, hd), np.nan, cp.float32)
        b1 = fdec(q, cache.k, cache.v, m, l, acc, block_table=table, seq_lens=lens, kps=kps,
                  splits_cap=cap, max_seq_len=PAGED_KEYS, **cache._scales, **opts.kwargs(kd),
                  validate_pos=False)
        b2 = fcomb(m, l, acc, out, n_splits=width)
        cp.cuda.runtime.deviceSynchronize()
        got = out.get().reshape(R, n_head, hd)
        for r in (0, R // 2, R - 1):  # every sequence runs the same code; three are checked
            _, (kr, vr) = _seq_rows(cache, host, sids[r], PAGED_KEYS)
            want = ref.decode_attention(qh[r], kr, vr, G, PAGED_KEYS, kps, cap, 0, 0,
                                        1 / math.sqrt(hd), tile=kd.tile_keys)
            _check(f"{kd.name} paged decode {kv} cap {cap} sequence {r}", got[r], want)
        name = f"{kd.name} kps {kps} cap {cap} ({width} splits)"
        if (kps, cap) == (dkps, dcap):
            name += " [default]"
        arms.append((name, replay([(fdec, b1), (fcomb, b2)]), nbytes, kd))
    return arms


def tiled_kernel(role, hd: int, groups: int):
    """The kernel (and launcher) the default choice would be without the query-tile
    forms: the block_tile baseline a query tile is timed beside."""
    from kgen.ir.geometry import query_tiles
    from kgen.runtime.select import find

    return find(role, hd, groups, where=lambda k: not query_tiles(k))


def paged_prefill_arm(cp, g, kv: str, tiled: bool = False):
    """(arm, FLOPs, kernel): PagedKVCache's causal varlen prefill of VARLEN requests
    (their rows appended first, from position 0), the attention launch bound once; the
    last rows of every request checked against the float64 reference. ``tiled``: the
    block_tile kernel the choice would be without the query tiles."""
    from kgen import numpy_ref as ref
    from kgen.runtime.options import Options
    from kgen.runtime.roles import ROLES

    hd, n_head, n_kv = PAGED_SHAPE
    G = n_head // n_kv
    reqs, n = VARLEN
    rows = [n] * reqs
    cache, host, sids = _paged_filled(cp, g, kv, rows)
    opts = Options.checked(n_head, 0, 0, None, None, 0.0, None, True)
    if tiled:
        kp, fn = tiled_kernel(replace(ROLES["prefill_paged"], kv=kv), hd, G)
    else:
        kp, fn = cache.kernels.get("prefill_paged", G, needs=opts.needs("prefill_paged"),
                                   rows=n)
    q = cp.asarray(g.standard_normal((sum(rows), n_head, hd), dtype=np.float32))
    out = cp.full(q.shape, np.nan, cp.float32)
    qsl = cp.asarray(np.concatenate([[0], np.cumsum(rows)]).astype(np.int32))
    b = fn(q, cache.k, cache.v, out, block_table=cp.asarray(cache.block_table(sids)),
           seq_lens=cp.asarray(np.array(rows, np.int32)), query_start_loc=qsl,
           max_query_len=n, **cache._scales, **opts.kwargs(kp, n_head), validate_pos=False)
    cp.cuda.runtime.deviceSynchronize()
    got, qh = out.get(), q.get()
    for i in (0, reqs - 1):
        dense, _ = _seq_rows(cache, host, sids[i], n)
        lo = i * n + n - 4
        want = ref.prefill_attention_cache(qh[lo:lo + 4], dense, G, n - 4, 0, 0, 0, 0,
                                           1 / math.sqrt(hd), tile=kp.tile_keys)
        _check(f"{kp.name} paged prefill {kv} request {i}", got[lo:lo + 4], want)
    flops = 4.0 * hd * n_head * reqs * n * (n + 1) / 2
    return f"{kp.name} ({reqs} x {n} rows)", replay([(fn, b)]), flops, kp


def paged_goals_table(cp, g) -> list[dict]:
    """The paged and chunked goals for every pageable format (KGEN_BENCH_KV): paged
    decode of PAGED_SEQS x PAGED_KEYS keys against its roofline (max(cache bytes / copy
    rate, 4 hd H keys / SGEMM rate)), the paged causal varlen prefill of VARLEN requests
    and KVCache's chunked prefill (PREFILL_ROWS rows at the end of a SEQ-key context) in
    TFLOP/s against SGEMM; head_dim, q and kv heads PAGED_SHAPE, default kernels and
    plans (an empty tune store), limits timed in this run."""
    from kgen.formats import FORMATS
    from kgen.ir.axes import Position
    from kgen.runtime.select import generated

    sgemm = _sgemm(cp)
    copy = _copy(cp)
    copy_gbps, sgemm_tf = _limits(cp, sgemm, copy)
    rows = [{"arm": "limits", "copy_GBps": copy_gbps, "sgemm_TFLOPs": sgemm_tf}]
    pageable = {k.kv.value for k, _ in generated() if k.position is Position.PAGED}
    hd, n_head, n_kv = PAGED_SHAPE
    for kv in _goal_kvs():
        fmt = FORMATS[kv]
        if not fmt.accepts_head_dim(hd):
            continue
        arms, meta = {}, {}
        if kv in pageable:
            flops = 4.0 * hd * n_head * PAGED_SEQS * PAGED_KEYS
            for name, arm, nbytes, k in paged_decode_arms(cp, g, kv):
                what = "paged decode" if name.endswith("[default]") else "paged decode (cap)"
                arms[name], meta[name] = arm, (what, k, nbytes, flops)
            for tiled in (False, True):
                name, arm, flops, k = paged_prefill_arm(cp, g, kv, tiled)
                if name not in arms:
                    what = "paged prefill (tiled)" if tiled else "paged prefill"
                    arms[name], meta[name] = arm, (what, k, 0, flops)
        cache, host = filled_cache(cp, g, kv, hd, n_kv=n_kv)
        q = cp.asarray(g.standard_normal((PREFILL_ROWS, n_head, hd), dtype=np.float32))
        ctx = SEQ - PREFILL_ROWS
        flops = 4.0 * hd * n_head * PREFILL_ROWS * (ctx + (PREFILL_ROWS + 1) / 2)
        base = tiled_kernel(cache.kernels._role("prefill"), hd, n_head // n_kv)
        for what, kernel in (("chunked prefill", None), ("chunked prefill (tiled)", base)):
            arm, out, k = prefill_arm(cp, cache, q, kernel)
            name = f"{k.name} ({PREFILL_ROWS} rows after {ctx} keys)"
            if name in arms:
                continue
            arm()
            cp.cuda.runtime.deviceSynchronize()
            _check(f"{k.name} chunked prefill {kv}", out.get()[-4:],
                   prefill_reference(cache, host, q.get(), k))
            arms[name], meta[name] = arm, (what, k, 0, flops)
        t, copy_now = _with_copy(cp, arms, copy)
        for name, ms in t.items():
            what, k, nbytes, flops = meta[name]
            roof = max(nbytes / (copy_now * 1e9), flops / (sgemm_tf * 1e12)) * 1e6
            row = {"kv": kv, "what": what, "arm": name, "kernel": k.name, "us": ms * 1e3,
                   "k80": k80(k, hd, n_head // n_kv),
                   "TFLOPs": flops / (ms * 1e-3) / 1e12,
                   "of_sgemm": flops / (ms * 1e-3) / 1e12 / sgemm_tf}
            if nbytes:
                row.update(GBps=nbytes / (ms * 1e-3) / 1e9, roofline_us=roof,
                           of_roofline=roof / (ms * 1e3), copy_GBps=copy_now)
            rows.append(row)
            goal = (f"{100 * row['of_roofline']:5.1f}% of the roofline ({roof:.1f} us)"
                    if nbytes else f"{100 * row['of_sgemm']:5.1f}% of SGEMM")
            print(f"paged_goals {kv} {what}: {ms * 1e3:9.1f} us {goal} ({name})", flush=True)
        del cache, host
    return rows


ROWS_SWEEP = tuple(int(x) for x in os.environ.get("KGEN_BENCH_ROWS", "1,4,16,64,128,512")
                   .split(","))  # query rows of a chunk after a context


SPLIT_SWEEP = tuple(int(x) for x in os.environ.get("KGEN_BENCH_PREFILL_SPLITS",
                                                  "1,2,4,8,16").split(","))


def prefill_split_table(cp, g) -> list[dict]:
    """The query-tile prefill whole and split over keys (its split twin at SPLIT_SWEEP
    splits, then the combine) beside the block_tile one, for chunks of ROWS_SWEEP rows at
    the end of a SEQ-key context (head_dim, q and kv heads PAGED_SHAPE; KGEN_BENCH_KV
    formats with a split twin), in TFLOP/s against SGEMM: where the plan's split count
    (kgen.runtime.plan.prefill_splits, marked [default]) stands among the others. Each
    arm checked against float64 first (the chunk's last row)."""
    from kgen import numpy_ref as ref
    from kgen.ir.geometry import prefill_grid
    from kgen.runtime.calls import Calls
    from kgen.runtime.planner import split_plan
    from kgen.runtime.select import generated, split_twin

    sgemm = _sgemm(cp)
    _, sgemm_tf = _limits(cp, sgemm, _copy(cp))
    hd, n_head, n_kv = PAGED_SHAPE
    G = n_head // n_kv
    rows = [{"arm": "limits", "sgemm_TFLOPs": sgemm_tf}]
    for kv in _goal_kvs():
        cache, host = filled_cache(cp, g, kv, hd, n_kv=n_kv)
        kp, fn = cache.kernels.get("prefill", G)
        twin = split_twin(kp, generated())
        if twin is None:
            del cache, host
            continue
        kb, fb = tiled_kernel(cache.kernels._role("prefill"), hd, G)
        _, fc = cache.kernels.get("combine")
        for n in ROWS_SWEEP:
            q = g.standard_normal((n, n_head, hd), dtype=np.float32)
            qd = cp.asarray(q)
            want = ref.prefill_attention_cache(q[-1:], host, G, SEQ - 1, 0, 0, 0, 0,
                                               1 / math.sqrt(hd))
            plan = split_plan(twin[0], hd, G, prefill_grid(kp, n, G, n_kv)[0] * n_kv)
            arms, names = {}, {}
            for s in ("tiled", *SPLIT_SWEEP):
                out = cp.full(qd.shape, np.nan, cp.float32)
                calls = Calls()
                if s == "tiled":
                    calls.add(fb, qd, cache.k, cache.v, *cache.shadows, out, pos0=SEQ - n,
                              **cache._shadow_args)
                    names[s] = kb.name
                elif s == 1:
                    calls.add(fn, qd, cache.k, cache.v, out, pos0=SEQ - n)
                    names[s] = kp.name
                else:
                    heads = n * n_head
                    m, l = cp.empty(heads * s, cp.float32), cp.empty(heads * s, cp.float32)
                    acc = cp.empty(heads * s * hd, cp.float32)
                    calls.add(twin[1], qd, cache.k, cache.v, m, l, acc, pos0=SEQ - n,
                              n_splits=s)
                    calls.add(fc, m, l, acc, out.reshape(heads, hd), n_splits=s)
                    names[s] = f"{twin[0].name} x {s}"
                arms[s] = replay(calls.run())
                cp.cuda.runtime.deviceSynchronize()
                _check(f"{names[s]} {n} rows {kv}", out.get()[-1:], want)
            t = bench(cp, arms)
            flops = 4.0 * hd * n_head * n * (SEQ - n + (n + 1) / 2)
            for s, ms in t.items():
                rows.append({"kv": kv, "rows": n, "splits": s, "kernel": names[s],
                             "us": ms * 1e3, "of_sgemm": flops / (ms * 1e-3) / 1e12 / sgemm_tf,
                             "default": s == plan})
                mark = " [default]" if s == plan else ""
                print(f"prefill_split {kv} {n:>4} rows {names[s]:<28} {ms * 1e3:9.1f} us "
                      f"{100 * rows[-1]['of_sgemm']:5.1f}% of SGEMM{mark}", flush=True)
        del cache, host
    return rows


def prefill_rows_table(cp, g) -> list[dict]:
    """The query-tile prefill beside the block_tile one, for chunks of ROWS_SWEEP rows at
    the end of a SEQ-key context (head_dim, q and kv heads PAGED_SHAPE; KGEN_BENCH_KV
    formats with a query tile), and which of the two KVCache's default choice is (the
    rows rule, kgen.runtime.select.fills): where a query tile of few rows, and so few
    blocks, stops paying. Each arm checked against float64 first."""
    from kgen import numpy_ref as ref
    from kgen.ir.geometry import query_tiles
    from kgen.runtime.select import find

    hd, n_head, n_kv = PAGED_SHAPE
    G = n_head // n_kv
    rows = []
    for kv in _goal_kvs():
        cache, host = filled_cache(cp, g, kv, hd, n_kv=n_kv)
        role = cache.kernels._role("prefill")
        tile = find(role, hd, G)
        if not query_tiles(tile[0]):
            continue
        base = tiled_kernel(role, hd, G)
        for n in ROWS_SWEEP:
            q = g.standard_normal((n, n_head, hd), dtype=np.float32)
            qd = cp.asarray(q)
            want = ref.prefill_attention_cache(q[-1:], host, G, SEQ - 1, 0, 0, 0, 0,
                                               1 / math.sqrt(hd))
            pick = cache.kernels.get("prefill", G, rows=n)
            chosen = pick[0].name
            arms, names = {}, {}
            others = (("default", pick),) if chosen not in (tile[0].name, base[0].name) else ()
            for what, (k, fn) in (("query tile", tile), ("tiled", base), *others):
                out = cp.full(qd.shape, np.nan, cp.float32)
                b = fn(qd, cache.k, cache.v, *cache.shadows, out, pos0=SEQ - n,
                       **cache._shadow_args)
                cp.cuda.runtime.deviceSynchronize()
                _check(f"{k.name} {n} rows {kv}", out.get()[-1:], want)
                arms[what], names[what] = replay([(fn, b)]), k.name
            t = bench(cp, arms)
            for what, ms in t.items():
                rows.append({"kv": kv, "rows": n, "what": what, "kernel": names[what],
                             "us": ms * 1e3, "vs_tiled": t["tiled"] / ms,
                             "default": names[what] == chosen})
            print(f"prefill_rows {kv} {n:>4} rows: query tile {names['query tile']} "
                  f"{t['query tile'] * 1e3:9.1f} us, tiled {names['tiled']} "
                  f"{t['tiled'] * 1e3:9.1f} us ({t['tiled'] / t['query tile']:.2f}x); "
                  f"default {chosen}", flush=True)
        del cache, host
    return rows


# ---- MLA (the engine's latent attention) -------------------------------------------

MLA_DECODES = ((16, 1, 4096), (16, 8, 4096), (16, 1, 32768), (128, 1, 4096),
               (128, 8, 4096), (128, 1, 32768))  # (q heads, requests, keys each)
MLA_BLOCK = 64                                    # positions per latent page
MLA_PREFILLS = ((16, 4096, 4096, True), (16, 512, 4096, False))  # (H, Lq, Lk, causal)


def _mla_decode_arm(cp, g, H: int, B: int, n: int):
    """(arm, bytes, FLOPs): mla_decode_attention (the default split count, the
    LSE written) of B requests of n keys each over scattered latent pages, bound once;
    the first and last requests checked against the float64 reference first."""
    from kgen import numpy_ref as ref
    from kgen.ir.geometry import MLA_LATENT, MLA_ROW
    from kgen.runtime.mla import mla_decode_attention

    blocks = -(-n // MLA_BLOCK)
    phys = g.permutation(B * blocks).astype(np.int32)
    table = phys.reshape(B, blocks)
    cache = g.standard_normal((B * blocks, MLA_BLOCK, MLA_ROW), dtype=np.float32)
    query = g.standard_normal((B, H, MLA_ROW), dtype=np.float32)
    lens = np.full(B, n, np.int32)
    scale = 1.0 / math.sqrt(MLA_ROW)
    dq, dc = cp.asarray(query), cp.asarray(cache)
    dt, dl = cp.asarray(table), cp.asarray(lens)
    out = cp.full((B, H, MLA_LATENT), np.nan, cp.float32)
    lse = cp.full((B, H), np.nan, cp.float32)
    bound = mla_decode_attention(out, lse, dq, dc, dt, dl, scale, 0, n)
    cp.cuda.runtime.deviceSynchronize()
    got, got_lse = out.get(), lse.get()
    for b in sorted({0, B - 1}):
        want, want_lse = ref.mla_decode(query[b:b + 1], cache, table[b:b + 1], lens[b:b + 1],
                                        scale, MLA_LATENT)
        _check(f"mla decode H{H} B{B} {n} keys request {b}", got[b:b + 1], want)
        _check(f"mla decode lse H{H} B{B} {n} keys request {b}", got_lse[b:b + 1], want_lse)
    nbytes = B * n * MLA_ROW * 4                      # every latent row read once
    flops = 2.0 * B * H * n * (MLA_ROW + MLA_LATENT)  # q.k over 576, p.v over 512
    return replay(bound), nbytes, flops


def _mla_prefill_arm(cp, g, H: int, Lq: int, Lk: int, causal: bool):
    """(arm, FLOPs): mla_prefill_attention of one request (QK 192, V 128); its last two
    rows checked against the float64 reference first."""
    from kgen import numpy_ref as ref
    from kgen.ir.geometry import MLA_PREFILL_QK, MLA_PREFILL_V
    from kgen.runtime.mla import mla_prefill_attention

    q = g.standard_normal((Lq, H, MLA_PREFILL_QK), dtype=np.float32)
    k = g.standard_normal((Lk, H, MLA_PREFILL_QK), dtype=np.float32)
    v = g.standard_normal((Lk, H, MLA_PREFILL_V), dtype=np.float32)
    scale = 1.0 / math.sqrt(MLA_PREFILL_QK)
    cu_q, cu_k = (cp.asarray(np.array([0, x], np.int32)) for x in (Lq, Lk))
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    out = cp.full((Lq, H, MLA_PREFILL_V), np.nan, cp.float32)

    def arm():  # the op's checks cost microseconds; the launch, milliseconds
        mla_prefill_attention(out, None, dq, dk, dv, cu_q, cu_k, scale, causal, Lq, Lk,
                              validate=False)
    arm()
    cp.cuda.runtime.deviceSynchronize()
    # The last two rows alone, bottom-right aligned, see what they see in the whole batch.
    want, _ = ref.mla_prefill(q[-2:], k, v, np.array([0, 2]), np.array([0, Lk]), scale, causal)
    _check(f"mla prefill H{H} {Lq}x{Lk}", out.get()[-2:], want)
    seen = (Lq * Lk - Lq * (Lq - 1) / 2) if causal else Lq * Lk  # (query, key) pairs
    return arm, 2.0 * H * seen * (MLA_PREFILL_QK + MLA_PREFILL_V)


def mla_goals_table(cp, g) -> list[dict]:
    """The MLA ops at the engine's shapes (DeepSeek V2-Lite's 16 q heads, V3's 128):
    the split decode over the paged latent cache (MLA_DECODES, pages of MLA_BLOCK) in
    GB/s of latent rows read and against its roofline (max(bytes / copy rate, FLOPs /
    SGEMM rate)), and the prefill (MLA_PREFILLS) in TFLOP/s against SGEMM; limits timed
    in this run, every arm checked against float64 first."""
    sgemm = _sgemm(cp)
    copy = _copy(cp)
    copy_gbps, sgemm_tf = _limits(cp, sgemm, copy)
    rows = [{"arm": "limits", "copy_GBps": copy_gbps, "sgemm_TFLOPs": sgemm_tf}]
    arms, meta = {}, {}
    for H, B, n in MLA_DECODES:
        name = f"mla decode H{H} B{B} {n} keys"
        arms[name], nbytes, flops = _mla_decode_arm(cp, g, H, B, n)
        meta[name] = ("decode", nbytes, flops)
    t, copy_now = _with_copy(cp, arms, copy)
    slow, slow_meta = {}, {}
    for H, Lq, Lk, causal in MLA_PREFILLS:
        name = f"mla prefill H{H} {Lq} rows x {Lk} keys {'causal' if causal else 'full'}"
        slow[name], flops = _mla_prefill_arm(cp, g, H, Lq, Lk, causal)
        slow_meta[name] = ("prefill", 0, flops)
    t.update(bench_slow(cp, slow))
    meta.update(slow_meta)
    for name, ms in t.items():
        what, nbytes, flops = meta[name]
        tf = flops / (ms * 1e-3) / 1e12
        row = {"what": what, "arm": name, "us": ms * 1e3, "TFLOPs": tf,
               "of_sgemm": tf / sgemm_tf}
        if nbytes:
            roof = max(nbytes / (copy_now * 1e9), flops / (sgemm_tf * 1e12)) * 1e6
            row.update(GBps=nbytes / (ms * 1e-3) / 1e9, roofline_us=roof,
                       of_roofline=roof / (ms * 1e3), copy_GBps=copy_now)
        rows.append(row)
        share = (f"{row['GBps']:7.0f} GB/s {100 * row['of_roofline']:5.1f}% of the roofline "
                 f"({row['roofline_us']:.1f} us)" if nbytes else
                 f"{tf:6.2f} TFLOP/s {100 * row['of_sgemm']:5.1f}% of SGEMM")
        print(f"mla_goals {name}: {ms * 1e3:10.1f} us {share}", flush=True)
    return rows


# ---- launch overhead ---------------------------------------------------------------

def launch_table(cp, g) -> list[dict]:
    """Host time per decode step at head_dim 256, f32, SEQ keys: in each of ROUNDS
    interleaved rounds every arm is called n times back to back, host and wall time
    divided by n; medians over the rounds (the GPU time of the same step measured
    with events beside it)."""
    from kgen.ir.geometry import streams
    from kgen.runtime.plan import decode_plan
    from kgen.runtime.select import decode_variants

    hd, n = 256, 50
    cache, _ = filled_cache(cp, g, "f32", hd)
    q1 = cp.asarray(g.standard_normal((H, hd), dtype=np.float32))
    k1 = cp.asarray(g.standard_normal((1, HK, hd), dtype=np.float32))
    kd, fdec = cache.kernels.get("decode", H // HK)
    plan = decode_plan(SEQ, LAUNCH_KPS, LAUNCH_CAP, kd.tile_keys)
    m, l, acc = cache.scratch.get(H, plan.n_splits, hd)
    b = fdec(q1, cache.k, cache.v, m, l, acc, seq_len=SEQ, n_splits=plan.n_splits,
             split_len=plan.split_len)
    raw_f = _function(fdec, b.kernel)

    def raw():
        raw_f(b.grid, b.block, b.args, shared_mem=b.shared_bytes)

    def launcher():
        fdec(q1, cache.k, cache.v, m, l, acc, seq_len=SEQ, n_splits=plan.n_splits,
             split_len=plan.split_len)

    from kgen.runtime.launch import bound_call

    planned = bound_call(fdec, q1, cache.k, cache.v, m, l, acc, seq_len=SEQ,
                         n_splits=plan.n_splits, split_len=plan.split_len)

    step, graphed, stream = _step_arms(cp, cache, q1, k1)
    arms = [("raw CuPy launch (split kernel)", raw, None),
            ("kgen launcher (split kernel)", launcher, None),
            ("kgen bound_call, then run (split kernel)", planned.run, None),
            ("KVCache.decode (append+split+combine)", step, None),
            ("CUDA graph of the same step", graphed, stream)]
    variants = decode_variants("f32", hd, H // HK, streams)
    if variants:  # the step as `kgen tune` picks it on a GPU like the H200
        fast, _ = filled_cache(cp, g, "f32", hd, variants=variants)
        s2, g2, st2 = _step_arms(cp, fast, q1, k1)
        arms += [(f"KVCache.decode, {variants['decode_dev']}", s2, None),
                 ("CUDA graph of that step", g2, st2)]
    host: dict[str, list[float]] = {name: [] for name, _, _ in arms}
    wall: dict[str, list[float]] = {name: [] for name, _, _ in arms}
    for _name, fn, _ in arms:
        for _ in range(5):
            fn()
    for _ in range(ROUNDS):  # interleaved: each round runs every arm n times
        for name, fn, _ in arms:
            cp.cuda.runtime.deviceSynchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            host[name].append((time.perf_counter() - t0) / n * 1e6)
            cp.cuda.runtime.deviceSynchronize()
            wall[name].append((time.perf_counter() - t0) / n * 1e6)
    rows = []
    for name, fn, sync in arms:
        rows.append({"arm": name, "host_us": statistics.median(host[name]),
                     "wall_us": statistics.median(wall[name]),
                     "gpu_us": _time(cp, fn, 20, sync) * 1e3})
    by = {r["arm"]: r for r in rows}
    raw_r, lau = by["raw CuPy launch (split kernel)"], by["kgen launcher (split kernel)"]
    dec, gra = by["KVCache.decode (append+split+combine)"], by["CUDA graph of the same step"]
    rows.append({"arm": "ratio: launcher host / raw host",
                 "value": lau["host_us"] / raw_r["host_us"], "goal": 1.2})
    rows.append({"arm": "ratio: bound_call run host / raw host (plan once, run)",
                 "value": by["kgen bound_call, then run (split kernel)"]["host_us"]
                 / raw_r["host_us"], "goal": 1.2})
    rows.append({"arm": "ratio: KVCache.decode wall / step GPU time (graph)",
                 "value": dec["wall_us"] / gra["gpu_us"], "goal": 1.15})
    if variants:
        d2, g2 = by[f"KVCache.decode, {variants['decode_dev']}"], by["CUDA graph of that step"]
        rows.append({"arm": f"ratio: the same with {variants['decode_dev']}",
                     "value": d2["wall_us"] / g2["gpu_us"], "goal": 1.15})
    return rows


def _step_arms(cp, cache, q1, k1):
    """(KVCache.decode step, its CUDA-graph replay, the graph's stream) at SEQ keys and
    the launch table's plan; the step's output is checked against the graph's."""
    hd = cache.head_dim

    def step():
        cache.length = 0
        return cache.decode(q1, k1, k1, pos=SEQ - 1, kps=LAUNCH_KPS, splits_cap=LAUNCH_CAP)

    pos = cp.asarray([SEQ - 1], cp.int32)
    out = cp.empty((q1.shape[0], hd), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    cache.decode_device(q1, k1, k1, pos, kps=LAUNCH_KPS, splits_cap=LAUNCH_CAP, out=out)
    with stream:
        stream.begin_capture()
        cache.decode_device(q1, k1, k1, pos, kps=LAUNCH_KPS, splits_cap=LAUNCH_CAP, out=out,
                            validate=False, stream=stream)
        graph = stream.end_capture()
    out.fill(np.nan)
    graph.launch(stream)
    stream.synchronize()
    if not np.array_equal(step().get(), out.get()):
        raise SystemExit("bench: a decode step and its graph replay differ; not timing them")

    def graphed(keep=(pos, out)):  # the graph reads and writes these: keep them alive
        graph.launch(stream)

    return step, graphed, stream


# ---- output ------------------------------------------------------------------------

def _of_limit(rows, label: str) -> list[dict]:
    """Rows with a measured fraction of their limit, as "pct" (the roofline where the
    row has one, else SGEMM), labelled by ``label`` over the row's keys."""
    return [{"arm": label.format(**r), "pct": 100 * r.get("of_roofline", r.get("of_sgemm", 0))}
            for r in rows if "of_sgemm" in r]


def charts(out: Path, record: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    for metric, label in (("prefill_us", "prefill µs (128 rows, 4k context)"),
                          ("decode_GBps", "decode GB/s of KV cache read (4k context)")):
        heads = record.get("heads")
        if not heads:
            break
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for kv in sorted({r["kv"] for r in heads}):
            pts = [(r["head_dim"], r[metric]) for r in heads if r["kv"] == kv]
            ax.plot(*zip(*pts, strict=True), marker="o", label=kv)
        ax.set_xlabel("head_dim")
        ax.set_ylabel(label)
        ax.set_title(f"{label} on {record['device']}")
        ax.legend()
        ax.grid(alpha=0.3)
        path = out / f"heads_{metric}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        made.append(str(path))
    goal = [r for r in record.get("decode_goals", ()) if "kv" in r and (r["best"] or r["default"])]
    if goal:
        keys = sorted({(r["kv"], r["head_dim"], r["n_head"], r["n_kv"], r["seq"]) for r in goal})
        fig, ax = plt.subplots(figsize=(9, 0.3 * len(keys) + 1.2))
        for i, (label, pick) in enumerate((("best kernel and plan", "best"),
                                           ("default (empty tune store)", "default"))):
            vals = [100 * next((r["of_roofline"] for r in goal if r[pick] and
                                (r["kv"], r["head_dim"], r["n_head"], r["n_kv"], r["seq"]) == k),
                               0.0) for k in keys]
            ax.barh([j + 0.4 * i for j in range(len(keys))], vals, height=0.4, label=label)
        ax.set_yticks([j + 0.2 for j in range(len(keys))],
                      [f"{k[0]} hd{k[1]} {k[2]}/{k[3]} {k[4]}" for k in keys], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("% of the roofline (max of bytes / copy rate, FLOPs / SGEMM rate)")
        ax.set_title(f"split decode on {record['device']}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="x")
        path = out / "decode_goals.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        made.append(str(path))
    bars = {  # section -> (rows to plot, value key, axis label)
        "decode_long": ([r for r in record.get("decode_long", ())
                         if not r["arm"].endswith("split only")], "GBps",
                        "GB/s of K+V read, f32 decode at 32k keys, head_dim 256"),
        "prefill_long": ([{**r, "arm": f"{r['n_head']}/{r['n_kv']} {r['kv']} hd{r['head_dim']} "
                                       f"{r['kernel']}"}
                          for r in record.get("prefill_long", ())], "ms",
                         "ms, causal prefill"),
        "launch": ([r for r in record.get("launch", ()) if "host_us" in r], "host_us",
                   "host µs per call"),
        "paged_goals": (_of_limit(record.get("paged_goals", ()), "{kv} {what} {kernel}"),
                        "pct", "% of the limit (decode: roofline; prefill: SGEMM)"),
        "prefill_rows": ([{**r, "arm": f"{r['kv']} {r['rows']} rows {r['what']}"
                           f"{' [default]' if r['default'] else ''}"}
                          for r in record.get("prefill_rows", ())], "vs_tiled",
                         "speed relative to the block_tile prefill of the same chunk"),
        "mla_goals": (_of_limit(record.get("mla_goals", ()), "{arm}"), "pct",
                      "% of the limit (decode: roofline; prefill: SGEMM)"),
    }
    for name, (rows, key, label) in bars.items():
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.2))
        ax.barh([r["arm"] for r in rows], [r[key] for r in rows])
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.set_title(f"{name} on {record['device']}")
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(alpha=0.3, axis="x")
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        made.append(str(path))
    return made


def _k80_text(row: dict) -> str:
    """A row's K80 occupancy (its kernel's sm_37 blocks and warps a SMX), if recorded."""
    o = row.get("k80")
    return f" [K80: {o['blocks']} blocks, {o['warps']} warps]" if o else ""


def _data(rows: list[dict]) -> list[dict]:
    """A section's rows without its limits rows (a merged record has one a run)."""
    return [r for r in rows if not r.get("arm", "").startswith("limits")]


def merged(records: list[dict]) -> dict:
    """One record from runs of one device, each of some sections (KGEN_BENCH_ONLY,
    KGEN_BENCH_KV, ...: a GPU lent a few minutes a command runs the benchmark in parts):
    a section's rows concatenated in run order. Every row carries its own measures
    against the limits of its run's rounds, so rows from different runs stay comparable
    with their limits, not with each other's times."""
    if not records:
        raise ValueError("no runs to merge")
    devices = {r["device"] for r in records}
    if len(devices) != 1:
        raise ValueError(f"runs on different devices: {', '.join(sorted(devices))}")
    out = {k: v for k, v in records[0].items() if not isinstance(v, list)}
    for rec in records:
        for name, rows in rec.items():
            if isinstance(rows, list):
                out.setdefault(name, []).extend(rows)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (no arguments), or ``report DIR...``: print and chart, into
    $KGEN_BENCH_OUT, the merged kernels.json of earlier runs (no GPU needed)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args:
        if args[0] != "report" or len(args) < 2:
            print("usage: python -m kgen.bench.kernels [report DIR...]", file=sys.stderr)
            return 2
        runs = [json.loads((Path(d) / "kernels.json").read_text()) for d in args[1:]]
        report(merged(runs), Path(os.environ.get("KGEN_BENCH_OUT", "bench-out")))
        return 0
    import cupy as cp

    from kgen.runtime.package import ensure_kgen_kernels

    ensure_kgen_kernels()
    g = np.random.default_rng(int(os.environ.get("KGEN_BENCH_SEED", "0")) or None)
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    record = {"device": dev["name"].decode(), "rounds": ROUNDS, "burst": BURST,
              "shape": {"n_head": H, "n_head_kv": HK, "seq": SEQ, "prefill_rows": PREFILL_ROWS,
                        "kps": KPS, "splits_cap": CAP}}
    sections = (("heads", heads_table), ("variants", variants_table),
                ("prefill_long", prefill_long_table), ("decode_long", decode_long_table),
                ("decode_goals", decode_goals_table), ("paged_goals", paged_goals_table),
                ("prefill_rows", prefill_rows_table), ("prefill_split", prefill_split_table),
                ("mla_goals", mla_goals_table),
                ("launch", launch_table))
    only = set(filter(None, os.environ.get("KGEN_BENCH_ONLY", "").split(",")))
    for name, fn in sections:
        if not only or name in only:
            record[name] = fn(cp, g)
    report(record, Path(os.environ.get("KGEN_BENCH_OUT", "bench-out")))
    return 0


def report(record: dict, out: Path) -> None:
    """Print a run's tables, and save its JSON and charts under ``out``."""
    print(f"kernel benchmark on {record['device']}: {ROUNDS} interleaved rounds x {BURST} "
          "launches, medians; every kernel checked against the NumPy reference first")
    if "heads" in record:
        print(f"\nheads: prefill {PREFILL_ROWS} rows at the end of a {SEQ}-key context, decode "
              f"at {SEQ} keys (kps {KPS}, cap {CAP}); {H} q heads, {HK} kv heads")
        print(f"  {'hd':>4} {'kv':<5} {'prefill kernel':<22} {'us':>9} {'decode kernel':<24} "
              f"{'us':>8} {'GB/s':>7}")
        for r in record["heads"]:
            print(f"  {r['head_dim']:>4} {r['kv']:<5} {r['prefill_kernel']:<22} "
                  f"{r['prefill_us']:9.1f} {r['decode_kernel']:<24} {r['decode_us']:8.1f} "
                  f"{r['decode_GBps']:7.1f}")
    if "variants" in record:
        print("\nvariants: prefill at head_dim 256, ratio = chosen kernel's time / variant's")
        for r in record["variants"]:
            mark = " (chosen)" if r["chosen"] else ""
            print(f"  {r['kv']:<5} {r['kernel']:<32} {r['us']:9.1f} us  {r['ratio']:5.2f}x{mark}")
    if "prefill_long" in record:
        print(f"\nprefill_long: causal prefill of {LONG_N} rows, q heads / kv heads as shown "
              "(ms; TFLOP/s = 2 N^2 hd H / time; % of the SGEMM timed in the same rounds; "
              "ratio = SDPA math f32's time (TF32 off: the SIMT peer) / the arm's)")
        for shape in sorted({(r["n_head"], r["n_kv"], r["kv"], r["head_dim"])
                             for r in record["prefill_long"]}):
            hq, hk, kv, hd = shape
            rs = [r for r in record["prefill_long"]
                  if (r["n_head"], r["n_kv"], r["kv"], r["head_dim"]) == shape]
            # The bar is the SIMT f32 peer (SDPA math, TF32 off), never a tensor-core arm.
            sd = next((r["ms"] for r in rs if r.get("peer")
                       and r["kernel"].endswith(SIMT_LABEL)), None)
            for r in rs:
                ratio = (f"  {sd / r['ms']:5.2f}x vs SDPA math" if sd and not r.get("sgemm")
                         else "")
                best = " (best kgen)" if r["best_kgen"] else ""
                print(f"  {hq}/{hk} {kv:<4} hd{hd:<4} {r['kernel']:<40} {r['ms']:9.2f} ms "
                      f"{r['TFLOPs']:6.2f} TFLOP/s {100 * r['of_sgemm']:5.1f}% SGEMM"
                      f"{ratio}{_k80_text(r)}{best}")
    if "decode_long" in record:
        print("\ndecode_long: f32 decode at 32768 keys, head_dim 256 (GB/s of K+V read)")
        for r in record["decode_long"]:
            share = f"  {r['of_copy'] * 100:5.1f}% of the copy" if "of_copy" in r else ""
            print(f"  {r['arm']:<64} {r['us']:9.1f} us {r['GBps']:8.1f} GB/s{share}")
    if "decode_goals" in record:
        lim = record["decode_goals"][0]
        print(f"\ndecode_goals: split decode + combine vs roofline = max(bytes / copy rate, "
              f"4 hd H keys / SGEMM {lim['sgemm_TFLOPs']:.1f} TFLOP/s), the copy timed in each "
              f"shape's rounds (alone at the start: {lim['copy_GBps']:.0f} GB/s), {lim['sms']} "
              "SMs; best arm and the default (empty tune store)")
        goal = [r for r in record["decode_goals"] if "kv" in r]
        for key in sorted({(r["kv"], r["head_dim"], r["n_head"], r["n_kv"], r["seq"])
                           for r in goal}):
            rs = [r for r in goal if (r["kv"], r["head_dim"], r["n_head"], r["n_kv"],
                                      r["seq"]) == key]
            b = next(r for r in rs if r["best"])
            d = next((r for r in rs if r["default"]), None)
            dtxt = (f" | default {d['us']:8.1f} us {100 * d['of_roofline']:5.1f}% "
                    f"({d['vs_best']:.2f}x best){_k80_text(d)}" if d else "")
            copy = f"copy {b['copy_GBps']:5.0f} GB/s " if "copy_GBps" in b else ""
            print(f"  {key[0]:<8} hd{key[1]:<3} {key[2]:>2}/{key[3]:<2} {key[4]:>6} keys: "
                  f"{copy}roof {b['roofline_us']:7.1f} us | best {b['us']:8.1f} us "
                  f"{100 * b['of_roofline']:5.1f}% {b['arm']}{_k80_text(b)}{dtxt}")
    if "paged_goals" in record:
        lim = record["paged_goals"][0]
        hd, n_head, n_kv = PAGED_SHAPE
        print(f"\npaged_goals: head_dim {hd}, {n_head}/{n_kv} heads; paged decode of "
              f"{PAGED_SEQS} x {PAGED_KEYS} keys vs roofline (the copy timed in each format's "
              f"rounds; alone at the start {lim['copy_GBps']:.0f} GB/s), paged prefill of "
              f"{VARLEN[0]} x {VARLEN[1]} rows and chunked prefill "
              f"vs SGEMM {lim['sgemm_TFLOPs']:.1f} TFLOP/s; default kernels and plans")
        for r in _data(record["paged_goals"]):
            copy = f" (copy {r['copy_GBps']:.0f} GB/s)" if "copy_GBps" in r else ""
            share = (f"{100 * r['of_roofline']:5.1f}% of roofline{copy}" if "of_roofline" in r
                     else f"{100 * r['of_sgemm']:5.1f}% of SGEMM")
            print(f"  {r['kv']:<8} {r['what']:<23} {r['us']:10.1f} us  {share}  {r['arm']}"
                  f"{_k80_text(r)}")
    if "prefill_rows" in record:
        hd, n_head, n_kv = PAGED_SHAPE
        print(f"\nprefill_rows: the query-tile prefill and the block_tile one, a chunk of "
              f"n rows after {SEQ} - n keys, head_dim {hd}, {n_head}/{n_kv} heads "
              "([default]: KVCache's choice for the chunk)")
        for r in record["prefill_rows"]:
            mark = " [default]" if r["default"] else ""
            print(f"  {r['kv']:<8} {r['rows']:>4} rows {r['what']:<10} {r['us']:10.1f} us  "
                  f"{r['vs_tiled']:5.2f}x the tiled  {r['kernel']}{mark}")
    if "prefill_split" in record:
        hd, n_head, n_kv = PAGED_SHAPE
        print(f"\nprefill_split: a chunk of n rows after {SEQ} - n keys, head_dim {hd}, "
              f"{n_head}/{n_kv} heads, vs SGEMM {record['prefill_split'][0]['sgemm_TFLOPs']:.1f} "
              "TFLOP/s ([default]: the plan's split count)")
        for r in _data(record["prefill_split"]):
            mark = " [default]" if r["default"] else ""
            print(f"  {r['kv']:<8} {r['rows']:>4} rows {r['kernel']:<28} {r['us']:10.1f} us  "
                  f"{100 * r['of_sgemm']:5.1f}% of SGEMM{mark}")
    if "mla_goals" in record:
        lim = record["mla_goals"][0]
        print(f"\nmla_goals: the MLA split decode (default split count, LSE written) over "
              f"pages of {MLA_BLOCK} vs roofline (copy timed with the decodes; alone "
              f"{lim['copy_GBps']:.0f} GB/s; SGEMM "
              f"{lim['sgemm_TFLOPs']:.1f} TFLOP/s), the MLA prefill vs SGEMM")
        for r in _data(record["mla_goals"]):
            share = (f"{r['GBps']:7.0f} GB/s {100 * r['of_roofline']:5.1f}% of roofline"
                     if "GBps" in r else
                     f"{r['TFLOPs']:6.2f} TFLOP/s {100 * r['of_sgemm']:5.1f}% of SGEMM")
            print(f"  {r['arm']:<48} {r['us']:10.1f} us  {share}")
    if "launch" in record:
        print(f"\nlaunch: one f32 decode step at head_dim 256, 4k context, kps {LAUNCH_KPS} cap "
              f"{LAUNCH_CAP} (host and wall µs per call)")
        for r in record["launch"]:
            if "value" in r:
                print(f"  {r['arm']:<52} {r['value']:6.2f}x  (goal <= {r['goal']}x)")
            else:
                print(f"  {r['arm']:<40} host {r['host_us']:8.1f}  wall {r['wall_us']:8.1f}  "
                      f"gpu {r['gpu_us']:8.1f}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(record, indent=1) + "\n")
    made = charts(out, record)
    why = "" if made or "heads" not in record else " (matplotlib not importable: no charts)"
    print(f"\nwrote {out / 'kernels.json'}" + (f" and {', '.join(made)}" if made else why))


if __name__ == "__main__":
    raise SystemExit(main())
