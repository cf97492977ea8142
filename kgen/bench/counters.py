"""`make bench-counters`: what bounds the default kernels of the goal shapes, read from
Nsight Compute's counters on the GPU at hand.

For each goal shape of `make bench-kernels` (kgen.bench.kernels: the split decode at
4k and 32k keys -- KGEN_BENCH_SEQS --, the paged decode of 32 x 4k keys, the causal
prefill of 8192 rows; every format -- KGEN_BENCH_KV --, the head sizes and heads of
those tables) the kernel the caches choose with an empty tune store, under its default
plan, is launched once and profiled: its time, its registers, the warps resident (of
the SM's maximum), and how busy each unit that can bound it was -- instruction issue,
the FP32 (FMA) pipe, shared memory's data pipe, DRAM -- as percentages of their peaks,
with the stall reasons per issued instruction. The busiest unit is printed as the
kernel's bound; a kernel whose busiest unit is well below its peak is bound by latency
at the warps it keeps resident.

The driver runs this module again under `ncu` (``--launch``), profiling only the
launches between cudaProfilerStart and Stop (setup, and the check of every output
against the float64 NumPy reference that comes first, run unprofiled). ncu runs with
``--clock-control none`` (the GPU's own clocks, as the timed benches see them) and
flushes caches before each profiled pass, so a kernel's time here is a cold-cache one.
ncu comes from $NCU, the PATH, or /usr/local/cuda/bin. KGEN_BENCH_ONLY (decode, paged,
prefill; comma-separated) keeps some sections, KGEN_BENCH_KV, KGEN_BENCH_HEAD_DIMS,
KGEN_BENCH_LONG_SHAPES and KGEN_BENCH_SEQS narrow them as in `make bench-kernels`. The
table is printed and saved as JSON under $KGEN_BENCH_OUT (default bench-out/counters.json).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# ncu metric -> (column, scale): the units that can bound a kernel, then what explains it.
METRICS = {
    "gpu__time_duration.sum": ("us", 1e-3),
    "launch__registers_per_thread": ("regs", 1),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("warps", 1),
    "sm__inst_issued.avg.pct_of_peak_sustained_active": ("issue", 1),
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": ("fma", 1),
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed":
        ("shared", 1),
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("dram", 1),
    "sm__inst_executed.sum": ("inst", 1),
}
STALLS = ("wait", "short_scoreboard", "long_scoreboard", "barrier", "math_pipe_throttle",
          "mio_throttle", "not_selected")
for _s in STALLS:
    METRICS[f"smsp__average_warps_issue_stalled_{_s}_per_issue_active.ratio"] = (_s, 1)

# The units a kernel's time can be bound by, as the percentage of their peak they ran at.
UNITS = {"issue": "instruction issue", "fma": "FP32 pipe", "shared": "shared memory",
         "dram": "DRAM"}


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def parse_csv(text: str) -> list[dict]:
    """ncu --csv output (one row per launch and metric) -> one dict per profiled launch,
    in launch order: its kernel name and a column per METRICS entry."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    launches: dict[int, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        name = row.get("Metric Name")
        if name not in METRICS:
            continue
        col, scale = METRICS[name]
        launch = launches.setdefault(int(row["ID"]), {"kernel": row["Kernel Name"]})
        launch[col] = _number(row["Metric Value"]) * scale
    return [launches[i] for i in sorted(launches)]


def busiest(row: dict) -> tuple[str, float]:
    """(unit, percent): the unit of UNITS that ran closest to its peak."""
    unit = max(UNITS, key=lambda u: row.get(u, 0.0))
    return unit, row.get(unit, 0.0)


# ---- the launches (run under ncu) ---------------------------------------------------

def _decode_items(cp, g, seqs) -> list[dict]:
    from kgen.bench import kernels as bk
    from kgen.formats import FORMATS
    from kgen.runtime.planner import kernel_plan

    items = []
    hds = tuple(h for h in bk._bench_head_dims() if h in (128, 256)) or (128, 256)
    for kv in bk._goal_kvs():
        fmt = FORMATS[kv]
        for hd in hds:
            if not fmt.accepts_head_dim(hd):
                continue
            for (n_head, n_kv), seq in ((s, n) for s in bk.GOAL_SHAPES for n in seqs):
                cache, q1, want = bk.decode_inputs(cp, g, kv, hd, n_head, n_kv, seq)
                k, fn = cache.kernels.get("decode", n_head // n_kv)
                _, fcomb = cache.kernels.get("combine")
                kps, cap = kernel_plan(k, hd, n_kv)
                b1, b2, out, plan = bk.split_arm(cp, cache, fn, fcomb, q1, seq, kps, cap,
                                                 k.tile_keys)
                run = bk.replay([(fn, b1), (fcomb, b2)])  # the launches hold their arrays
                run()
                cp.cuda.runtime.deviceSynchronize()
                bk._check(f"{k.name} {kv} hd{hd} {n_head}/{n_kv} {seq}", out.get(), want)
                items.append({"what": "decode", "kv": kv, "head_dim": hd, "n_head": n_head,
                              "n_kv": n_kv, "keys": seq, "splits": plan.n_splits,
                              "bytes": 2 * n_kv * seq * fmt.row_bytes(hd),
                              "kernels": [b1.kernel, b2.kernel], "run": run})
    return items


def _paged_items(cp, g) -> list[dict]:
    from kgen.bench import kernels as bk
    from kgen.formats import FORMATS
    from kgen.ir.axes import Position
    from kgen.runtime.select import generated

    hd, n_head, n_kv = bk.PAGED_SHAPE
    pageable = {k.kv.value for k, _ in generated() if k.position is Position.PAGED}
    items = []
    for kv in bk._goal_kvs():
        if kv not in pageable or not FORMATS[kv].accepts_head_dim(hd):
            continue
        name, run, nbytes, k = bk.paged_decode_arms(cp, g, kv)[0]  # the default plan first
        items.append({"what": "paged decode", "kv": kv, "head_dim": hd, "n_head": n_head,
                      "n_kv": n_kv, "keys": bk.PAGED_KEYS, "sequences": bk.PAGED_SEQS,
                      "bytes": nbytes, "arm": name, "run": run,
                      "kernels": [k.name, None]})  # the split kernel, then its combine
    return items


def _prefill_items(cp, g) -> list[dict]:
    from kgen.bench import kernels as bk
    from kgen.formats import FORMATS

    N = bk.LONG_N
    items = []
    for (H, HK), kv, hd in ((s, kv, hd) for s in bk.LONG_SHAPES for kv in bk._goal_kvs()
                            for hd in bk._bench_head_dims()):
        if not FORMATS[kv].accepts_head_dim(hd):
            continue
        cache, q, _, _, want = bk.long_prefill_inputs(cp, g, H, HK, kv, hd)
        k, fn = cache.kernels.get("prefill", H // HK, rows=N)
        out = cp.full(q.shape, np.nan, cp.float32)
        b = fn(cp.asarray(q), cache.k, cache.v, *cache.shadows, out, pos0=0,
               **cache._shadow_args)
        cp.cuda.runtime.deviceSynchronize()
        bk._check(f"{k.name} {kv} hd{hd} {H}/{HK}", out.get()[-2:], want)
        items.append({"what": "prefill", "kv": kv, "head_dim": hd, "n_head": H, "n_kv": HK,
                      "rows": N, "flops": 2.0 * N * N * hd * H, "kernels": [b.kernel],
                      "run": bk.replay([(fn, b)])})
    return items


def _seqs() -> tuple[int, ...]:
    got = os.environ.get("KGEN_BENCH_SEQS", "4096,32768")
    return tuple(int(x) for x in got.split(",") if x)


def launch(record: Path) -> int:
    """Set up and check every item, then launch each once between cudaProfilerStart and
    Stop; write the items (what each launch was) to ``record``."""
    import cupy as cp
    import cupyx.profiler

    from kgen.runtime.package import ensure_kgen_kernels

    ensure_kgen_kernels()
    g = np.random.default_rng(int(os.environ.get("KGEN_BENCH_SEED", "0")) or None)
    only = set(filter(None, os.environ.get("KGEN_BENCH_ONLY", "").split(",")))
    items = []
    if not only or "decode" in only:
        items += _decode_items(cp, g, _seqs())
    if not only or "paged" in only:
        items += _paged_items(cp, g)
    if not only or "prefill" in only:
        items += _prefill_items(cp, g)
    cp.cuda.runtime.deviceSynchronize()
    with cupyx.profiler.profile():  # ncu --profile-from-start off: only these launches
        for it in items:
            it["run"]()
            cp.cuda.runtime.deviceSynchronize()
    record.write_text(json.dumps([{k: v for k, v in it.items() if k != "run"}
                                  for it in items]))
    return 0


# ---- the driver ---------------------------------------------------------------------

def find_ncu() -> str | None:
    for cand in (os.environ.get("NCU"), shutil.which("ncu"), "/usr/local/cuda/bin/ncu"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def attribute(items: list[dict], launches: list[dict]) -> list[dict]:
    """Each item's profiled launches, in order (a decode: its split kernel, then the
    combine); the kernel names recorded for an item (None: not known beforehand) must
    be the ones ncu saw."""
    rows, i = [], 0
    for it in items:
        want = it["kernels"]
        got = launches[i:i + len(want)]
        i += len(want)
        if len(got) != len(want) or any(w is not None and w != x["kernel"]
                                        for w, x in zip(want, got, strict=True)):
            raise SystemExit(f"bench-counters: ncu profiled {[x['kernel'] for x in got]} "
                             f"where {want} ran")
        main, *rest = got
        row = {**{k: v for k, v in it.items() if k != "kernels"}, **main,
               "others_us": sum(x["us"] for x in rest)}
        if "bytes" in it:
            row["GBps"] = it["bytes"] / (main["us"] * 1e-6) / 1e9
            row["inst_per_key"] = main["inst"] / (it["keys"] * it["n_kv"] *
                                                  it.get("sequences", 1))
        if "flops" in it:
            row["TFLOPs"] = it["flops"] / (main["us"] * 1e-6) / 1e12
        row["bound"], row["bound_pct"] = busiest(main)
        rows.append(row)
    if i != len(launches):
        raise SystemExit(f"bench-counters: {len(launches) - i} profiled launches unaccounted")
    return rows


def report(rows: list[dict]) -> None:
    print("bench-counters: the default kernel of each goal shape, once, under ncu "
          "(cold caches, the GPU's clocks); % of each unit's peak; stalls per issued "
          "instruction")
    for r in rows:
        shape = (f"{r['what']:<12} {r['kv']:<8} hd{r['head_dim']:<3} "
                 f"{r['n_head']:>2}/{r['n_kv']:<2}")
        size = (f"{r['rows']} rows" if "rows" in r else
                f"{r.get('sequences', 1)}x{r['keys']} keys")
        rate = (f"{r['TFLOPs']:6.2f} TFLOP/s" if "TFLOPs" in r else
                f"{r['GBps']:6.0f} GB/s {r['inst_per_key']:6.1f} inst/key")
        stalls = " ".join(f"{s}={r.get(s, 0):.2f}" for s in STALLS)
        print(f"  {shape} {size:<14} {r['kernel']:<30} {r['us']:10.1f} us  {rate}  "
              f"regs {r['regs']:.0f} warps {r['warps']:4.1f}% | issue {r['issue']:4.1f}% "
              f"fma {r['fma']:4.1f}% shared {r['shared']:4.1f}% dram {r['dram']:4.1f}% "
              f"-> {UNITS[r['bound']]} | {stalls}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--launch"]:
        return launch(Path(argv[1]))
    ncu = find_ncu()
    if ncu is None:
        print("bench-counters: Nsight Compute's ncu not found (set NCU, or put it on the "
              "PATH)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        record, log = Path(tmp) / "items.json", Path(tmp) / "ncu.csv"
        child = [sys.executable, *(["-I"] if sys.flags.isolated else []), "-m",
                 "kgen.bench.counters", "--launch", str(record)]
        cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--csv",
               "--log-file", str(log), "--metrics", ",".join(METRICS), *child]
        done = subprocess.run(cmd, check=False)
        if done.returncode != 0 or not record.is_file():
            print(f"bench-counters: ncu exited {done.returncode}"
                  + (f"; its log:\n{log.read_text()[-4000:]}" if log.is_file() else ""),
                  file=sys.stderr)
            return done.returncode or 1
        rows = attribute(json.loads(record.read_text()), parse_csv(log.read_text()))
    report(rows)
    out = Path(os.environ.get("KGEN_BENCH_OUT", "bench-out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "counters.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\nwrote {out / 'counters.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
