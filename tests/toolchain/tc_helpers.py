"""Helpers of the toolchain tier: kgen runs in and out of process, tiny CUDA
sources, and the scratch workspace the ``ws`` fixture builds in."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

from kgen import cli
from kgen.compiler import pipeline
from kgen.compiler.atomic import read_tree
from kgen.config import DEFAULTS, Settings
from kgen.toolchain.cache import Cache

REPO = Path(__file__).resolve().parents[2]
# Every path setting kgen has (now or later): inputs and outputs alike.
PATH_KEYS = tuple(DEFAULTS)
# Settings kgen only reads; every other one it may write. Tests point each of
# those at a scratch directory, so a build never writes into the repo, whatever
# outputs kgen grows.
INPUT_KEYS = ("reference", "specs", "templates")
OUTPUT_KEYS = tuple(k for k in PATH_KEYS if k not in INPUT_KEYS)
SETTINGS_ENV = (*(f"KGEN_{k.upper()}" for k in PATH_KEYS), "KGEN_CACHE_DIR", "KGEN_CUDA_HOME")

TINY_CU = r"""
extern "C" __global__ void kgen_tiny(float *out, const float *in, float s, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        out[i] = in[i] * s + 1.0f;
}

extern "C" __global__ void kgen_tiny_smem(float *out)
{
    __shared__ float buf[64];
    buf[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = buf[63 - threadIdx.x];
}
"""

BROKEN_CU = r"""
extern "C" __global__ void kgen_broken(float *out)
{
    out[0] = kgen_undefined_name;
}
"""


@dataclass
class Run:
    rc: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def kgen_main(*argv: str) -> Run:
    """``kgen ARGV`` in this process (settings from the environment)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(list(argv))
    return Run(rc, out.getvalue(), err.getvalue())


def repo_context(cache_dir: Path) -> pipeline.Context:
    """The stages' context for the repo's own inputs and outputs, with a cache of its own
    (whatever KGEN_* the environment sets)."""
    settings = Settings(root=REPO, cache_dir=cache_dir,
                        **{k: REPO / v for k, v in DEFAULTS.items() if k != "reference"},
                        reference=(REPO / DEFAULTS["reference"]).resolve())
    return pipeline.Context(settings, Cache(cache_dir))


def scratch_settings(scratch: Path) -> dict[str, str]:
    """KGEN_<KEY> -> a path under ``scratch``, for every setting kgen may write."""
    return {f"KGEN_{k.upper()}": str(scratch / k) for k in OUTPUT_KEYS}


def kgen_env(scratch: Path, **settings: str | Path) -> dict[str, str]:
    """os.environ without KGEN_* settings, every output under ``scratch``, then
    ``settings`` (key -> KGEN_KEY)."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS_ENV}
    env.update(scratch_settings(scratch))
    env.update({f"KGEN_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def kgen_process(*argv: str, scratch: Path, **settings: str | Path) -> subprocess.Popen:
    """``python -m kgen ARGV`` as its own process, started now."""
    return subprocess.Popen(
        [sys.executable, "-m", "kgen", *argv], cwd=REPO, env=kgen_env(scratch, **settings),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def covering_specs() -> list[str]:
    """The fewest of the repo's spec files, by kernels compiled, whose kernels reach
    every skeleton (op x schedule), every KV format (K's and V's) and every I/O dtype
    the whole set has: what the cold builds of the determinism and shared-cache tests
    compile. A build of every spec runs once per CI (make build, kgen verify pins each
    kernel's SASS); two more cold ones of it, side by side on a two-core runner, took
    over twenty minutes each at 1201 kernels, and grow with every spec added. Chosen
    greedily, most new features per kernel first, ties by path; counts come from the
    specs."""
    kernels = pipeline.checked(pipeline.parse([REPO / "specs"], REPO))
    feats: dict[str, set[tuple]] = {}
    size: dict[str, int] = {}
    for k in kernels:
        f = feats.setdefault(k.spec_path, set())
        f |= {("skeleton", k.op, k.schedule), ("kv", k.kv), ("kv", k.v_kv),
              ("io", k.in_dtype), ("io", k.out_dtype)}
        size[k.spec_path] = size.get(k.spec_path, 0) + 1
    need = set().union(*feats.values())
    chosen: list[str] = []
    while need:
        best = min((p for p in feats if feats[p] & need),
                   key=lambda p: (size[p] / len(feats[p] & need), p))
        chosen.append(best)
        need -= feats[best]
    return [str(REPO / p) for p in sorted(chosen)]


def finish(procs: list[subprocess.Popen], timeout: float = 1200) -> list[Run]:
    """Each process's outcome, in order. Cold builds of the covering specs run side by
    side here (a minute or two on a two-core runner); these tests check outputs, not
    speed (make bench-build), and the bound only stops a hang: past it every process
    still running is killed (none is left to load the tests after it) and the test
    fails."""
    runs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            runs.append(Run(proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.communicate()
        raise AssertionError(f"kgen runs still going after {timeout:.0f} s: killed") from None
    return runs


def cache_temp_dirs(cache_dir: Path) -> list[Path]:
    """Leftovers of unfinished writes: Cache.put's private dirs start with a dot."""
    return [p for p in cache_dir.rglob(".*")]


@dataclass
class Workspace:
    """A scratch copy of specs/, templates/, golden/ and generated/, selected
    through KGEN_* variables."""

    root: Path
    specs: Path
    templates: Path
    generated: Path
    golden: Path
    cache: Path

    def kgen(self, *argv: str) -> Run:
        return kgen_main(*argv)

    def tree(self, which: str) -> dict[str, bytes]:
        return read_tree(getattr(self, which))

    def edit(self, path: Path, old: str, new: str) -> None:
        text = path.read_text(encoding="utf-8")
        assert text.count(old) == 1, f"{path}: expected exactly one {old!r} to edit"
        path.write_text(text.replace(old, new), encoding="utf-8")
