"""``kgen doctor``: what this machine can do with kgen, and why.

It reports the GPUs (name, compute capability), the NVIDIA driver (its version
and the CUDA version it supports), the CuPy package (name and version, or why it
is not importable), which image of every generated module's fatbin the driver
will load on each GPU and why (kgen.runtime.loadcheck's decision), and whether
the CUDA 11.8 toolchain for building is present.

Nothing is loaded onto a GPU and nothing is installed; it works without a GPU,
without CuPy and without the toolchain. Exit status: 0, also on a machine that
cannot build or cannot run the kernels (that is what the report is for); 1 only
when something is broken: a generated module's fatbin is missing or unreadable,
or KGEN_CUDA_HOME names a directory without a CUDA 11.8 toolchain.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kgen import __version__
from kgen.config import Settings
from kgen.runtime import loadcheck, manifest
from kgen.runtime.kernels import candidates, installed_dir
from kgen.runtime.loadcheck import Device, v

SMI_TIMEOUT_S = 20
CUPY_EXTRAS = {11: "cuda11", 12: "cuda12"}  # 13 and newer: cuda13


def extra_for(cuda_major: int) -> str | None:
    """The kgen extra (CuPy package) for a driver of this CUDA major version."""
    if cuda_major < 11:
        return None
    return CUPY_EXTRAS.get(cuda_major, "cuda13")


@dataclass
class Gpu:
    index: int
    name: str
    cc: tuple[int, int] | None  # None: not known (CuPy missing, nvidia-smi too old)
    source: str  # "cupy" or "nvidia-smi"


@dataclass
class Driver:
    release: str = ""  # 470.256.02
    cuda: tuple[int, int] | None = None  # (11, 4)
    note: str = ""  # why it is not known


@dataclass
class CupyInfo:
    packages: list[tuple[str, str]] = field(default_factory=list)  # (distribution, version)
    importable: bool = False
    version: str = ""
    runtime: tuple[int, int] | None = None  # the CUDA runtime it runs on
    error: str = ""


@dataclass
class ModuleReport:
    name: str
    fatbin: str
    images: list[str] = field(default_factory=list)
    # per GPU index: (image loaded or None, reason, other images and why not)
    loads: dict[int, dict] = field(default_factory=dict)
    error: str = ""


@dataclass
class Report:
    kgen: str
    gpus: list[Gpu]
    driver: Driver
    cupy: CupyInfo
    generated: str
    modules: list[ModuleReport]
    image_needs: dict[str, str]
    toolchain: dict
    problems: list[str]
    notes: list[str]

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0


# -- probes ---------------------------------------------------------------------------


def _smi(*args: str) -> str | None:
    """nvidia-smi's output, or None when it is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        proc = subprocess.run([smi, *args], capture_output=True, text=True, check=False,
                              timeout=SMI_TIMEOUT_S, env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def smi_cuda_version(text: str) -> tuple[int, int] | None:
    """``CUDA Version: 11.4`` from nvidia-smi's banner."""
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2])) if m else None


def probe_cupy() -> CupyInfo:
    info = CupyInfo()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "cupy" or name.startswith("cupy-cuda"):
            info.packages.append((name, dist.version))
    info.packages.sort()
    if importlib.util.find_spec("cupy") is None:
        info.error = "no cupy package in this environment"
        return info
    try:
        import cupy

        info.version = cupy.__version__
        info.importable = True
        info.runtime = loadcheck.cuda_version(cupy.cuda.runtime.runtimeGetVersion())
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        info.error = f"{type(exc).__name__}: {exc}".strip()
    return info


def probe_gpus(cupy_info: CupyInfo) -> tuple[list[Gpu], Driver]:
    """GPUs and driver: CuPy's view when it can see devices, else nvidia-smi's."""
    driver = Driver(release=loadcheck.driver_release())
    gpus: list[Gpu] = []
    cupy_note = ""
    if cupy_info.importable:
        try:
            import cupy

            driver.cuda = loadcheck.cuda_version(cupy.cuda.runtime.driverGetVersion())
            for i in range(cupy.cuda.runtime.getDeviceCount()):
                dev = loadcheck.cupy_device(cupy, i)
                gpus.append(Gpu(i, dev.name, dev.cc, "cupy"))
        except Exception as exc:
            cupy_note = f"CuPy sees none ({type(exc).__name__}: {exc})".strip()
    if not gpus:
        rows = _smi("--query-gpu=index,name,driver_version,compute_cap",
                    "--format=csv,noheader")
        with_cc = rows is not None
        if rows is None:  # nvidia-smi older than compute_cap (before R510)
            rows = _smi("--query-gpu=index,name,driver_version", "--format=csv,noheader")
        for row in (rows or "").splitlines():
            cells = [c.strip() for c in row.split(",")]
            if len(cells) < 3 or not cells[0].isdigit():
                continue
            cc = None
            if with_cc and len(cells) > 3 and re.fullmatch(r"\d+\.\d+", cells[3]):
                cc = tuple(int(x) for x in cells[3].split("."))
            gpus.append(Gpu(int(cells[0]), cells[1], cc, "nvidia-smi"))
            driver.release = driver.release or cells[2]
        if driver.cuda is None:
            banner = _smi()
            driver.cuda = smi_cuda_version(banner) if banner else None
    if not gpus:
        why = [cupy_note or ("" if cupy_info.importable else "CuPy is not installed"
                             if not cupy_info.packages else "CuPy is not importable")]
        why.append("nvidia-smi not found" if shutil.which("nvidia-smi") is None
                   else "nvidia-smi lists no GPU")
        driver.note = "; ".join(w for w in why if w)
    return gpus, driver


def _generated_dir(settings: Settings) -> Path:
    """The built tree kgen_kernels imports (kgen.runtime.kernels.locate's order), else
    the settings' generated/."""
    for d in candidates(installed_dir()):
        if (d / manifest.MANIFEST).is_file():
            return d
    return settings.generated


def probe_toolchain() -> dict:
    from kgen.errors import ToolchainError
    from kgen.toolchain.locate import find_toolchain

    try:
        tc = find_toolchain()
    except ToolchainError as exc:
        return {"present": False, "error": str(exc)}
    tools = {t: getattr(tc, t) for t in ("nvcc", "ptxas", "cuobjdump", "fatbinary")}
    versions = {**dict(tc.versions), "fatbinary": tc.fatbinary_version}
    return {"present": True, "tools": tools, "versions": versions,
            "host_compiler": tc.host_compiler}


# -- the report -----------------------------------------------------------------------


def report(settings: Settings) -> Report:
    cupy_info = probe_cupy()
    gpus, driver = probe_gpus(cupy_info)
    problems: list[str] = []
    notes: list[str] = []
    generated = _generated_dir(settings)
    modules: list[ModuleReport] = []
    needs: dict[str, str] = {}
    try:
        built = manifest.read(generated)
        by_module = built.modules
    except manifest.ManifestError as exc:
        by_module = {}
        problems.append(f"no built kernels in {generated} ({exc}); run `kgen build specs/`")
    for name, entries in sorted(by_module.items()):
        m = ModuleReport(name, f"{len(entries)} fatbin{'s' if len(entries) != 1 else ''}")
        modules.append(m)
        try:
            seen = {tuple(loadcheck.images(built.fatbin(e.name))) for e in entries}
        except (OSError, ValueError) as exc:
            m.error = f"{type(exc).__name__}: {exc}"
            problems.append(f"{name}: a fatbin is unreadable ({m.error}); run "
                            "`kgen build specs/`")
            continue
        if len(seen) != 1:
            m.error = "its kernels' fatbins offer different images"
            problems.append(f"{name}: {m.error}; run `kgen build specs/`")
            continue
        (offered,) = seen
        m.images = [str(i) for i in offered]
        needs.update({str(i): i.needs() for i in offered})
        for g in gpus:
            if g.cc is None or driver.cuda is None:
                m.loads[g.index] = {"image": None, "reason": "compute capability or driver "
                                    "CUDA version unknown (install CuPy to see them)",
                                    "rejected": []}
                continue
            d = loadcheck.decide(offered, Device(g.cc, driver.cuda, g.name, driver.release))
            m.loads[g.index] = {
                "image": str(d.image) if d.image else None, "reason": d.reason,
                "rejected": [[str(i), why] for i, why in d.rejected],
                **({} if d.ok else {"advice": loadcheck.advice(offered, d.device)})}
    tc = probe_toolchain()
    if not tc["present"] and os.environ.get("KGEN_CUDA_HOME"):
        problems.append(f"KGEN_CUDA_HOME={os.environ['KGEN_CUDA_HOME']} holds no CUDA 11.8 "
                        "toolchain")
    if gpus and not cupy_info.importable:
        extra = extra_for(driver.cuda[0]) if driver.cuda else None
        notes.append("CuPy is needed to run the kernels: "
                     + (f"pip install 'kgen[{extra}]' (driver CUDA {v(driver.cuda)})" if extra
                        else "see README, Installing"))
    if len(cupy_info.packages) > 1:
        notes.append("more than one CuPy package is installed ("
                     + ", ".join(p for p, _ in cupy_info.packages) + "); keep the one for "
                     "this driver")
    return Report(__version__, gpus, driver, cupy_info, str(generated), modules, needs, tc,
                  problems, notes)


def as_json(r: Report) -> str:
    return json.dumps(asdict(r) | {"exit_code": r.exit_code}, indent=2, default=list)


def _cupy_line(c: CupyInfo) -> str:
    pkgs = ", ".join(f"{p} {ver}" for p, ver in c.packages) or "no CuPy package"
    if c.importable:
        rt = f", CUDA runtime {v(c.runtime)}" if c.runtime else ""
        return f"{pkgs} (imports{rt})"
    if not c.packages:
        return ("not installed: pip install 'kgen[cuda11|cuda12|cuda13]' by the driver's CUDA "
                "version (not needed to build or verify)")
    return f"{pkgs}, not importable: {c.error}"


def run_verdict(r: Report) -> str:
    """Whether the generated kernels can run here, in a few words."""
    if not r.gpus:
        return "no: no GPU found"
    if not r.cupy.importable:
        return "no: CuPy is not importable (see the note)"
    stuck = sorted({m.name for m in r.modules for load in m.loads.values() if not load["image"]})
    if stuck or not r.modules:
        return f"no: {', '.join(stuck) or 'no generated modules'} cannot load (see why above)"
    used = sorted({load["image"] for m in r.modules for load in m.loads.values()})
    return f"yes, every module ({' and '.join(used)})"


def as_text(r: Report) -> str:
    out = [f"kgen doctor (kgen {r.kgen})", ""]

    def row(key: str, value: str) -> None:
        out.append(f"  {key:<14}{value}")

    out.append("GPU")
    if not r.gpus:
        row("GPUs", f"none found: {r.driver.note}" if r.driver.note else "none found")
    for g in r.gpus:
        cc = f"compute {v(g.cc)}" if g.cc else "compute capability unknown"
        row(f"device {g.index}", f"{g.name}, {cc}")
    cuda = f"CUDA {v(r.driver.cuda)}" if r.driver.cuda else ""
    if r.driver.release:
        drv = r.driver.release + (f" ({cuda})" if cuda else "")
    elif r.gpus:
        drv = f"version unknown ({cuda or 'CUDA version unknown'})"
    else:
        drv = "no NVIDIA kernel driver loaded" + (
            f" (its user-space library, libcuda, is {cuda})" if cuda else "")
    row("driver", drv)
    row("CuPy", _cupy_line(r.cupy))
    out += ["", f"Generated modules ({r.generated})"]
    w = max((len(m.name) for m in r.modules), default=0)
    for m in r.modules:
        if m.error:
            out.append(f"  {m.name:<{w}}  {m.fatbin}: {m.error}")
            continue
        if not r.gpus:
            out.append(f"  {m.name:<{w}}  {m.fatbin}: {' + '.join(m.images)}")
        for g in r.gpus:
            load = m.loads[g.index]
            on = f"device {g.index}: " if len(r.gpus) > 1 else ""
            what = f"loads {load['image']}" if load["image"] else "CANNOT LOAD"
            out.append(f"  {m.name:<{w}}  {m.fatbin}: {on}{what}")
    if r.modules and not r.gpus:
        out.append("  no GPU here, so nothing is loaded; what each image needs:")
        out += [f"    {img}: {need}" for img, need in r.image_needs.items()]
    for g in r.gpus:  # the reasons, once per distinct decision
        seen: list[tuple] = []
        for m in r.modules:
            load = m.loads.get(g.index)
            if load is None:
                continue
            key = (load["image"], load["reason"], tuple(map(tuple, load["rejected"])))
            if key in seen:
                continue
            seen.append(key)
            on = f"device {g.index}" if len(r.gpus) > 1 else "this GPU"
            names = [x.name for x in r.modules
                     if x.loads.get(g.index) and (x.loads[g.index]["image"],
                                                  x.loads[g.index]["reason"]) == key[:2]]
            scope = "every module" if len(names) == len(r.modules) else ", ".join(names)
            out.append(f"  why ({scope}, {on}): {load['reason']}")
            out += [f"    not {img}: {why}" for img, why in load["rejected"]]
            if load.get("advice"):
                out.append(f"    to run them: {load['advice']}")
    out += ["", "Build toolchain (CUDA 11.8, for kgen build / verify)"]
    tc = r.toolchain
    if tc["present"]:
        for t, p in tc["tools"].items():
            ver = tc["versions"].get(t, "").replace("Cuda compilation tools, ", "")
            row(t, f"{p} ({ver})")
    else:
        row("absent", tc["error"])
    out += ["", "Summary"]
    row("build/verify", "yes (CUDA 11.8 toolchain present)" if tc["present"] else
        "no: no CUDA 11.8 toolchain (`make setup` installs it)")
    row("run kernels", run_verdict(r))
    if r.notes or r.problems:
        out.append("")
    out += [f"note: {n}" for n in r.notes]
    out += [f"problem: {p}" for p in r.problems]
    return "\n".join(out)
