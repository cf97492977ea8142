"""`kgen tune`: choose the decode plan and variant per shape class on the GPU at
hand, and remember the choice.

A shape class is (KV format, head_dim, kv_groups, context bucket). For each,
every generated decode kernel that serves it is run with every candidate plan
(keys per split x split cap); each candidate's output is first checked against
the float64 NumPy reference (outputs are reset to NaN between candidates), then
the survivors are timed in interleaved rounds. The fastest is stored in a JSON
cache keyed by device name and driver version, each entry carrying the source
hash of the kernel's module: an entry whose kernel source changed since is
stale and ignored. ``KVCache.decode`` asks :func:`tuned` when no plan is given.

Prefill is tuned per (KV format, head_dim, kv_groups, batch rows bucket): every exact prefill kernel
that serves the class with no attention options (tile shapes, register K, shared
V, rows per block; fp16 q or K tiles are left to be named, never chosen for a
caller) is checked on a batch at the end of a context, then timed, and
``KVCache.prefill`` uses the fastest (:func:`tuned_prefill`) when no variant is
named and no option is asked for.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

KPS = (64, 128, 256, 512, 1024)
CAPS = (16, 32, 64, 128, 256)
DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768)


@dataclass(frozen=True)
class Choice:
    kernel: str
    source_sha256: str
    kps: int
    splits_cap: int
    us: float


def bucket(seq_len: int) -> int:
    """The context bucket a length falls in: the next power of two (at least 1024)."""
    return max(1024, 1 << max(seq_len - 1, 1).bit_length())


def shape_key(kv: str, head_dim: int, groups: int, seq_len: int) -> str:
    return f"decode/{kv}/hd{head_dim}/g{groups}/ctx{bucket(seq_len)}"


def cache_path(device: str, driver: int) -> Path:
    from kgen.config import Settings

    root = Path(os.environ.get("KGEN_TUNE_DIR") or Path(Settings.load().cache_dir) / "tune")
    safe = "".join(c if c.isalnum() else "_" for c in device)
    return root / f"{safe}-driver{driver}.json"


def _device() -> tuple[str, int]:
    """The current device's name and the driver's version (asked once per device:
    neither changes while a process runs, and the properties query is slow)."""
    import cupy as cp

    index = cp.cuda.runtime.getDevice()
    d = _devices.get(index)
    if d is None:
        props = cp.cuda.runtime.getDeviceProperties(index)
        d = _devices[index] = (props["name"].decode(), cp.cuda.runtime.driverGetVersion())
    return d


_devices: dict[int, tuple[str, int]] = {}


def module_sha(kernel: str) -> str:
    """The hash of the source ``kernel`` was compiled from (its manifest entry): a
    stored choice names the kernel as it was built."""
    import kgen_kernels

    e = kgen_kernels.MANIFEST.kernels.get(kernel)
    return e.source_sha256 if e is not None else ""


def load(device: str, driver: int) -> dict[str, Choice]:
    try:
        raw = json.loads(cache_path(device, driver).read_text())
    except (OSError, ValueError):
        return {}
    return {k: Choice(**v) for k, v in raw.get("choices", {}).items()}


def tuned(kv: str, head_dim: int, groups: int, seq_len: int) -> Choice | None:
    """The stored choice for this shape class on this GPU and driver, unless stale.
    KVCache.decode asks on every step without a plan: the store is read (and its
    stale entries dropped) once, until ``kgen tune`` saves or ``_loaded`` is
    cleared."""
    table = _table()
    if table is None:
        return None
    shape = (kv, head_dim, groups, bucket(seq_len))  # shape_key's parts, looked up once
    c = table.get(shape, _UNSEEN)
    if c is _UNSEEN:
        c = table[shape] = table.get(shape_key(kv, head_dim, groups, seq_len))
    return c


def _table() -> dict | None:
    """This GPU and driver's current entries (stale ones dropped), read once; None
    without CuPy or a GPU (nothing tuned applies)."""
    try:
        key = _device()
    except Exception:
        return None
    table = _loaded.get(key)
    if table is None:
        table = _loaded[key] = {k: c for k, c in load(*key).items()
                                if c.source_sha256 == module_sha(c.kernel)}
    return table


_UNSEEN = object()
# Per device and driver: the current entries by shape_key, and the lookups made by
# (kv, head_dim, groups, bucket).
_loaded: dict[tuple[str, int], dict] = {}


def _save(device: str, driver: int, choices: dict[str, Choice]) -> Path:
    import tempfile

    path = cache_path(device, driver)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"device": device, "driver": driver,
            "choices": {k: asdict(v) for k, v in sorted(choices.items())}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tune-")
    with os.fdopen(fd, "w") as f:  # a reader sees the old file or the new one
        f.write(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    _loaded.pop((device, driver), None)
    return path


def tune_class(cp, kv: str, head_dim: int, groups: int, seq_len: int, say=print) -> Choice:
    """Check, then time, every (kernel, plan) candidate of one shape class."""
    from kgen import numpy_ref as ref
    from kgen.bench.kernels import HK, bench, filled_cache, replay
    from kgen.ir.axes import Mode, Op, Position
    from kgen.runtime.bind import shape_refusal
    from kgen.runtime.plan import decode_plan
    from kgen.runtime.select import Role, generated

    g = np.random.default_rng(0)
    cache, host = filled_cache(cp, g, kv, head_dim, seq_len)
    H = HK * groups
    q1 = cp.asarray(g.standard_normal((H, head_dim), dtype=np.float32))
    kr, vr = ref.read_kv_rows(host, seq_len - 1, cache.sink, cache.win)
    role = Role(Op.FLASH, Position.HOST, Mode.DECODE, kv)
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
        for kps in KPS:
            for cap in CAPS:
                plan = decode_plan(seq_len, kps, cap, k.tile_keys)
                if (plan.n_splits, plan.split_len) in seen:
                    continue  # another (kps, cap) already gives this plan
                seen[(plan.n_splits, plan.split_len)] = f"{k.name}/{kps}/{cap}"
                m = cp.full(H * plan.n_splits, np.nan, cp.float32)
                l = cp.full(H * plan.n_splits, np.nan, cp.float32)  # noqa: E741
                acc = cp.full(H * plan.n_splits * head_dim, np.nan, cp.float32)
                out = cp.full((H, head_dim), np.nan, cp.float32)
                b1 = fdec(q1, cache.k, cache.v, *cache.shadows, m, l, acc, seq_len=seq_len,
                          n_splits=plan.n_splits, split_len=plan.split_len,
                          **cache._shadow_args)
                b2 = fcomb(m, l, acc, out, n_splits=plan.n_splits)
                got = out.get()
                if np.isnan(got).any() or not np.allclose(got, want, rtol=2e-4, atol=2e-5):
                    say(f"  {k.name} kps {kps} cap {cap}: wrong output, not timed")
                    continue
                name = f"{k.name}/{kps}/{cap}"
                arms[name] = replay([(fdec, b1), (fcomb, b2)])
                meta[name] = (k.name, kps, cap)
        if k.name == cache.kernels.get("decode", groups)[0].name:
            p = decode_plan(seq_len, 256, 16, k.tile_keys)  # KVCache's untuned plan
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


def rows_bucket(rows: int) -> int:
    """The prefill batch bucket a row count falls in: the next power of two (at least 128)."""
    return max(128, 1 << max(rows - 1, 1).bit_length())


def prefill_key(kv: str, head_dim: int, groups: int, rows: int) -> str:
    return f"prefill/{kv}/hd{head_dim}/g{groups}/rows{rows_bucket(rows)}"


def tuned_prefill(kv: str, head_dim: int, groups: int, rows: int) -> Choice | None:
    """The stored prefill choice for this class on this GPU and driver, unless stale
    (kps and splits_cap are 0: a prefill has no plan)."""
    table = _table()
    return None if table is None else table.get(prefill_key(kv, head_dim, groups, rows))


def tune_prefill_class(cp, kv: str, head_dim: int, groups: int, rows: int,
                       say=print) -> Choice:
    """Check, then time, every exact prefill kernel serving one class: a batch of
    ``rows`` rows (at most what one KVCache launch takes) at the end of a context of
    at least 4096 keys."""
    from kgen import numpy_ref as ref
    from kgen.bench.kernels import ATOL, HK, RTOL, bench, filled_cache, replay
    from kgen.ir.axes import KStage, Mode, Op, Position, QStage
    from kgen.runtime.bind import shape_refusal
    from kgen.runtime.select import Role, generated, options

    g = np.random.default_rng(0)
    seq = max(4096, rows)
    cache, host = filled_cache(cp, g, kv, head_dim, seq)
    n = min(rows, cache.max_prefill_chunk())
    pos0 = seq - n
    qh = g.standard_normal((n, HK * groups, head_dim), dtype=np.float32)
    q = cp.asarray(qh)
    role = Role(Op.FLASH, Position.HOST, Mode.PREFILL, kv)
    default = cache.kernels.get("prefill", groups)[0].name
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
    device, driver = _device()
    choices = load(device, driver)
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
    path = _save(device, driver, choices)
    say(f"wrote {path}")
    return path
