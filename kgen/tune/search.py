"""`kgen tune`: choose the decode plan and variant per shape class on the GPU at
hand, and remember the choice.

A shape class is (KV format, head_dim, kv_groups, context bucket). For each,
every generated decode kernel that serves it is run with every candidate plan
(keys per split x split cap); each candidate's output is first checked against
the float64 NumPy reference (outputs are reset to NaN between candidates), then
the survivors are timed in interleaved rounds. The fastest is stored in the tune
store (kgen.runtime.tuned: a JSON file per device name and driver version, each
entry carrying the source hash of the kernel's module: an entry whose kernel
source changed since is stale and ignored). ``KVCache.decode`` asks
:func:`kgen.runtime.tuned.tuned` when no plan is given.

Prefill is tuned per (KV format, head_dim, kv_groups, batch rows bucket): every
exact prefill kernel that serves the class with no attention options (tile
shapes, register K, shared V, rows per block; fp16 q or K tiles are left to be
named, never chosen for a caller) is checked on a batch at the end of a context,
then timed, and ``KVCache.prefill`` uses the fastest
(:func:`kgen.runtime.tuned.tuned_prefill`) when no variant is named and no
option is asked for.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from kgen.runtime import tuned as store
from kgen.runtime.tuned import Choice, module_sha, prefill_key, shape_key

KPS = (64, 128, 256, 512, 1024)
CAPS = (16, 32, 64, 128, 256)
DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768)


def tune_class(cp, kv: str, head_dim: int, groups: int, seq_len: int, say=print) -> Choice:
    """Check, then time, every (kernel, plan) candidate of one shape class."""
    from kgen import numpy_ref as ref
    from kgen.bench.kernels import HK, bench, filled_cache, replay, split_arm
    from kgen.runtime.bind import shape_refusal
    from kgen.runtime.plan import decode_plan
    from kgen.runtime.planner import kernel_plan
    from kgen.runtime.roles import ROLES
    from kgen.runtime.select import generated

    g = np.random.default_rng(0)
    cache, host = filled_cache(cp, g, kv, head_dim, seq_len)
    H = HK * groups
    q1 = cp.asarray(g.standard_normal((H, head_dim), dtype=np.float32))
    kr, vr = ref.read_kv_rows(host, seq_len - 1, cache.sink, cache.win)
    role = replace(ROLES["decode"], kv=kv)  # a KVCache's decode over kv rows
    _, fcomb = cache.kernels.get("combine")
    arms, meta, default = {}, {}, None
    for k, fdec in generated():
        if not role.matches(k) or shape_refusal(k, head_dim, groups) is not None:
            continue
        if cache.fmt.shadows and (k.ring_rows, k.sink_rows) != (cache.RING_ROWS,
                                                                cache.SINK_ROWS):
            continue
        want = ref.decode_attention(q1.get(), kr, vr, groups, seq_len, 1, 1, 0, 0,
                                    1 / math.sqrt(head_dim), tile=k.tile_keys)
        seen: dict[tuple[int, int], str] = {}
        chosen = k.name == cache.kernels.get("decode", groups)[0].name
        plans = [(kps, cap) for kps in KPS for cap in CAPS]
        if chosen:  # the plan the cache uses untuned (derived from this device)
            plans.append(kernel_plan(k, head_dim, HK))
        for kps, cap in plans:
            plan = decode_plan(seq_len, kps, cap, k.tile_keys)
            if (plan.n_splits, plan.split_len) in seen:
                continue  # another (kps, cap) already gives this plan
            seen[(plan.n_splits, plan.split_len)] = f"{k.name}/{kps}/{cap}"
            b1, b2, out, plan = split_arm(cp, cache, fdec, fcomb, q1, seq_len, kps, cap,
                                          k.tile_keys)
            got = out.get()
            if np.isnan(got).any() or not np.allclose(got, want, rtol=2e-4, atol=2e-5):
                say(f"  {k.name} kps {kps} cap {cap}: wrong output, not timed")
                continue
            name = f"{k.name}/{kps}/{cap}"
            arms[name] = replay([(fdec, b1), (fcomb, b2)])
            meta[name] = (k.name, kps, cap)
        if chosen:
            kps, cap = kernel_plan(k, head_dim, HK)
            p = decode_plan(seq_len, kps, cap, k.tile_keys)
            default = seen.get((p.n_splits, p.split_len))
    if not arms:
        raise SystemExit(f"tune: nothing serves decode kv={kv} head_dim={head_dim} "
                         f"groups={groups}")
    times = bench(cp, arms)
    best = min(times, key=times.get)
    name, kps, cap = meta[best]
    base = times.get(default, float("nan")) * 1e3
    say(f"  {shape_key(kv, head_dim, groups, seq_len)}: {len(arms)} candidates checked; "
        f"best {name} kps {kps} cap {cap} {times[best] * 1e3:.1f} us (default kernel and "
        f"plan {base:.1f} us)")
    return Choice(name, module_sha(name), kps, cap, times[best] * 1e3)


def tune_prefill_class(cp, kv: str, head_dim: int, groups: int, rows: int,
                       say=print) -> Choice:
    """Check, then time, every exact prefill kernel serving one class: a batch of
    ``rows`` rows (at most what one KVCache launch takes) at the end of a context of
    at least 4096 keys."""
    from kgen import numpy_ref as ref
    from kgen.bench.kernels import ATOL, HK, RTOL, bench, filled_cache, replay
    from kgen.ir.axes import KStage, QStage
    from kgen.runtime.bind import shape_refusal
    from kgen.runtime.roles import ROLES
    from kgen.runtime.select import generated, options

    g = np.random.default_rng(0)
    seq = max(4096, rows)
    cache, host = filled_cache(cp, g, kv, head_dim, seq)
    n = min(rows, cache.max_prefill_chunk())
    pos0 = seq - n
    qh = g.standard_normal((n, HK * groups, head_dim), dtype=np.float32)
    q = cp.asarray(qh)
    role = replace(ROLES["prefill"], kv=kv)  # a KVCache's prefill over kv rows
    default = cache.kernels.get("prefill", groups, rows=n)[0].name
    arms = {}
    for k, f in generated():
        if (not role.matches(k) or options(k) or shape_refusal(k, head_dim, groups)
                or k.q_stage is QStage.F16 or k.k_stage is KStage.SHARED_F16):
            continue
        if cache.fmt.shadows and (k.ring_rows, k.sink_rows) != (cache.RING_ROWS,
                                                                cache.SINK_ROWS):
            continue
        out = cp.full(q.shape, np.nan, cp.float32)
        b = f(q, cache.k, cache.v, *cache.shadows, out, pos0=pos0, **cache._shadow_args)
        floor = (ref.prefill_live_floor(pos0, n, cache.RING_ROWS)
                 if k.ring_floor.value == "batch" else None)
        want = ref.prefill_attention_cache(qh[-4:], host, groups, seq - 4, cache.sink,
                                           cache.win, 0, 0, 1 / math.sqrt(head_dim), floor,
                                           tile=k.tile_keys)
        got = out.get()[-4:]
        if np.isnan(got).any() or not np.allclose(got, want, rtol=RTOL, atol=ATOL):
            say(f"  {k.name}: wrong output, not timed")
            continue
        arms[k.name] = replay([(f, b)])
    if not arms:
        raise SystemExit(f"tune: nothing serves prefill kv={kv} head_dim={head_dim} "
                         f"groups={groups}")
    times = bench(cp, arms)
    best = min(times, key=times.get)
    base = times.get(default, float("nan")) * 1e3
    say(f"  {prefill_key(kv, head_dim, groups, rows)}: {len(arms)} candidates checked; best "
        f"{best} {times[best] * 1e3:.1f} us (default {default} {base:.1f} us)")
    return Choice(best, module_sha(best), 0, 0, times[best] * 1e3)


def main(kvs, head_dims, groups_list, contexts, say=print, prefill_rows=(128, 2048)) -> Path:
    import cupy as cp

    from kgen.formats import FORMATS
    from kgen.runtime.package import ensure_kgen_kernels

    ensure_kgen_kernels()
    device, driver = store.current_device()
    choices = store.load(device, driver)
    say(f"tuning decode and prefill on {device} (driver {driver})")
    for kv in kvs:
        for hd in head_dims:
            if not FORMATS[kv].accepts_head_dim(hd):
                continue
            for groups in groups_list:
                for rows in prefill_rows:
                    choices[prefill_key(kv, hd, groups, rows)] = tune_prefill_class(
                        cp, kv, hd, groups, rows, say)
                for ctx in contexts:
                    c = tune_class(cp, kv, hd, groups, ctx, say)
                    choices[shape_key(kv, hd, groups, ctx)] = c
    path = store.save(device, driver, choices)
    say(f"wrote {path}")
    return path
