"""`make bench-build`: kgen's build speed against nvcc on the same machine, side by side.

Every arm runs as the commands a person types, in fresh processes, in rounds
that interleave the arms (so drift in machine load hits all of them), and the
median of the rounds is reported. Outputs go to a scratch directory; the
checkout's generated/ is not touched.

  nvcc      nvcc -cubin -arch=sm_37 of the whole reference (the yardstick)
  cold      kgen build specs/ && kgen verify with an empty cache
  noop      kgen build specs/ again (nothing changed)
  one-spec  kgen build after editing one spec (only its module recompiles)
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kgen.config import Settings
from kgen.toolchain.locate import TARGET_ARCH, find_toolchain

ROUNDS = 3
TARGETS = {"cold / nvcc": 1.5, "noop seconds": 0.5}


def _run(argv: list[str], env: dict, cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"bench: {' '.join(argv)} failed:\n{proc.stdout}{proc.stderr}")
    return dt


def main() -> int:
    s = Settings.load()
    tc = find_toolchain()
    kgen = [sys.executable, "-m", "kgen"]
    scratch = Path(tempfile.mkdtemp(prefix="kgen-bench-"))
    times: dict[str, list[float]] = {k: [] for k in ("nvcc", "cold", "noop", "one-spec")}
    try:
        specs = scratch / "specs"
        shutil.copytree(s.specs, specs)
        edited = specs / "util.kspec"
        original = edited.read_text(encoding="utf-8")
        for r in range(ROUNDS):
            env = {**os.environ, "KGEN_CACHE_DIR": str(scratch / f"cache{r}"),
                   "KGEN_GENERATED": str(scratch / f"gen{r}")}
            times["nvcc"].append(_run(
                [tc.nvcc, "-cubin", f"-arch={TARGET_ARCH}", "-Wno-deprecated-gpu-targets",
                 str(s.reference), "-o", str(scratch / "ref.cubin")], tc.env(), scratch))
            t = _run([*kgen, "build", "-q", str(specs)], env, s.root)
            t += _run([*kgen, "verify", "-q"], env, s.root)
            times["cold"].append(t)
            times["noop"].append(_run([*kgen, "build", "-q", str(specs)], env, s.root))
            edited.write_text(original.replace("split the joint", f"split (round {r}) the joint"),
                              encoding="utf-8")
            times["one-spec"].append(_run([*kgen, "build", "-q", str(specs)], env, s.root))
            edited.write_text(original, encoding="utf-8")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"kgen build benchmark, {ROUNDS} interleaved rounds, medians, {os.cpu_count()} cores")
    for k, v in times.items():
        print(f"  {k:<9} {med[k]:6.2f} s   (rounds: {', '.join(f'{x:.2f}' for x in v)})")
    ratios = {"cold / nvcc": med["cold"] / med["nvcc"],
              "one-spec / cold": med["one-spec"] / med["cold"],
              "noop seconds": med["noop"]}
    ok = True
    for k, v in ratios.items():
        target = TARGETS.get(k)
        verdict = "" if target is None else ("  ok" if v <= target else f"  OVER target {target}")
        ok &= target is None or v <= target
        print(f"  {k:<16} {v:5.2f}{verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
