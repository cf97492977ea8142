"""`kgen doctor`: a readable report and exit 0 on this machine, whatever it has, and
the right per-module verdicts for simulated GPUs and drivers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kgen import doctor
from kgen.cli import main
from kgen.testing.built import BUILT, GENERATED, needs_build

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(BUILT.modules) if BUILT else []
# What a module's line names: its kernels' fatbins, counted.
FATBINS = {m: f"{len(es)} fatbin{'s' if len(es) != 1 else ''}"
           for m, es in (BUILT.modules.items() if BUILT else ())}
W = max(map(len, MODULES), default=0)  # the report's module column


def run(capsys, *args) -> tuple[int, str]:
    rc = main(["doctor", *args])
    out, err = capsys.readouterr()
    assert err == ""
    return rc, out


@pytest.fixture
def no_gpu(monkeypatch):
    """A CPU-only machine: no CuPy, no nvidia-smi, no kernel driver."""
    monkeypatch.setattr(doctor, "probe_cupy",
                        lambda: doctor.CupyInfo(error="no cupy package in this environment"))
    real_which = shutil.which
    monkeypatch.setattr(doctor.shutil, "which",
                        lambda name, *a, **k: None if name == "nvidia-smi" else
                        real_which(name, *a, **k))
    monkeypatch.setattr(doctor.loadcheck, "driver_release", lambda: "")


def gpu(monkeypatch, name, cc, cuda, release):
    monkeypatch.setattr(doctor, "probe_cupy", lambda: doctor.CupyInfo(
        packages=[("cupy-cuda11x", "13.6.0")], importable=True, version="13.6.0",
        runtime=(11, 8)))
    monkeypatch.setattr(doctor, "probe_gpus", lambda info: (
        [doctor.Gpu(0, name, cc, "cupy")], doctor.Driver(release, cuda)))


@needs_build
def test_doctor_runs_here_and_exits_0(capsys):
    rc, out = run(capsys)
    assert rc == 0, out
    for section in ("GPU", "Generated modules", "Build toolchain", "Summary"):
        assert f"\n{section}" in out
    for m in MODULES:
        assert f"\n  {m} " in out
    rc, out = run(capsys, "--json")
    data = json.loads(out)
    assert rc == 0 and data["exit_code"] == 0
    assert [m["name"] for m in data["modules"]] == MODULES


@needs_build
def test_doctor_on_a_cpu_only_machine(capsys, no_gpu):
    rc, out = run(capsys)
    assert rc == 0
    assert "GPUs          none found: CuPy is not installed; nvidia-smi not found" in out
    assert "driver        no NVIDIA kernel driver loaded" in out
    assert "CuPy          not installed: pip install 'kgen[cuda11|cuda12|cuda13]'" in out
    for m in MODULES:
        assert f"  {m:<{W}}  {FATBINS[m]}: sm_37 SASS + compute_37 PTX (ISA 7.8)" in out
    assert "sm_37 SASS: compute 3.7 GPU, driver CUDA 11.0 (R450+) or newer" in out
    assert "compute_37 PTX (ISA 7.8): compute >= 3.7 GPU, driver CUDA 11.8 (R520+) or newer" in out
    assert "run kernels   no: no GPU found" in out
    data = json.loads(run(capsys, "--json")[1])
    assert data["gpus"] == [] and data["cupy"]["importable"] is False
    assert all(m["images"] == ["sm_37 SASS", "compute_37 PTX (ISA 7.8)"] for m in data["modules"])


@needs_build
def test_doctor_k80_on_r470(capsys, monkeypatch):
    gpu(monkeypatch, "Tesla K80", (3, 7), (11, 4), "470.256.02")
    rc, out = run(capsys)
    assert rc == 0
    assert "device 0      Tesla K80, compute 3.7" in out
    assert "driver        470.256.02 (CUDA 11.4)" in out
    for m in MODULES:
        assert f"{m:<{W}}  {FATBINS[m]}: loads sm_37 SASS" in out
    assert "why (every module, this GPU): its sm_37 SASS runs natively on compute 3.7" in out
    assert "not compute_37 PTX (ISA 7.8): its PTX (ISA 7.8) needs a CUDA 11.8 (R520+) " \
           "driver; this host's is CUDA 11.4" in out
    assert "run kernels   yes, every module (sm_37 SASS)" in out


@needs_build
def test_doctor_k80_on_a_new_driver(capsys, monkeypatch):
    gpu(monkeypatch, "Tesla K80", (3, 7), (12, 2), "535.216.01")
    rc, out = run(capsys)
    assert rc == 0  # the report is the answer; nothing is broken for building
    for m in MODULES:
        assert f"{m:<{W}}  {FATBINS[m]}: CANNOT LOAD" in out
    assert "is a Kepler GPU" in out and "install the R470 driver (CUDA 11.4)" in out
    data = json.loads(run(capsys, "--json")[1])
    assert all(m["loads"]["0"]["image"] is None and "R470" in m["loads"]["0"]["advice"]
               for m in data["modules"])


@needs_build
def test_doctor_h200_on_r580(capsys, monkeypatch):
    gpu(monkeypatch, "NVIDIA H200", (9, 0), (13, 0), "580.159.04")
    rc, out = run(capsys)
    assert rc == 0
    for m in MODULES:
        assert f"{m:<{W}}  {FATBINS[m]}: loads compute_37 PTX (ISA 7.8)" in out
    assert "JIT-compiled for compute 9.0 by the CUDA 13.0 driver" in out


@needs_build
def test_a_broken_fatbin_is_exit_1(capsys, monkeypatch, tmp_path, no_gpu):
    gen = tmp_path / "generated"
    shutil.copytree(GENERATED, gen)
    (gen / BUILT.modules[MODULES[0]][0].fatbin).write_bytes(b"not a fatbin")
    monkeypatch.setenv("KGEN_GENERATED", str(gen))
    rc, out = run(capsys)
    assert rc == 1
    assert f"problem: {MODULES[0]}: a fatbin is unreadable (FatbinError: not a fatbin" in out


@pytest.mark.parametrize("major, extra", [(10, None), (11, "cuda11"), (12, "cuda12"),
                                          (13, "cuda13"), (14, "cuda13")])
def test_the_cupy_extra_follows_the_driver(major, extra):
    assert doctor.extra_for(major) == extra


def test_nvidia_smi_banner_parsing():
    banner = "| NVIDIA-SMI 470.256.02   Driver Version: 470.256.02   CUDA Version: 11.4     |"
    assert doctor.smi_cuda_version(banner) == (11, 4)
    assert doctor.smi_cuda_version("NVIDIA-SMI has failed") is None
