"""Which image of a module the driver will load on a GPU, or why none can -- decided
in pure Python before the driver is asked, so a host that cannot run the kernels
gets a sentence saying what is wrong and what to do instead of
CUDA_ERROR_UNSUPPORTED_PTX_VERSION or CUDA_ERROR_NO_BINARY_FOR_GPU.

The rules (``decide``):

- Kepler GPUs (compute 3.x) are supported by no driver newer than R470, the
  CUDA 11.4 branch. A Kepler GPU under a newer driver is reported as such.
- SASS for sm_XY runs on a GPU of compute X.Z with Z >= Y (for kgen's sm_37:
  a compute 3.7 GPU, the K80) under a driver of CUDA >= 11.0: the cubin is built
  by CUDA 11.8, and CUDA 11.x drivers (R450 and newer) load cubins of any 11.x
  toolkit (minor-version compatibility; it does not extend to PTX).
- PTX for compute_XY is JIT-compiled on a GPU of compute >= X.Y by a driver whose
  CUDA version is at least the one that introduced the PTX's ISA version
  (``PTX_ISA_CUDA``: ISA 7.8 needs CUDA 11.8, 7.4 needs 11.4, 7.0 needs 11.0).
- SASS that loads is preferred over PTX (it is the code ``kgen verify`` checked).

Versions are (major, minor) tuples: a compute capability (3, 7), a CUDA version
(11, 4) as cuDriverGetVersion reports it (11040).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kgen.toolchain import fatbin

# PTX ISA version -> the first CUDA release (and so driver) that accepts it.
PTX_ISA_CUDA: dict[tuple[int, int], tuple[int, int]] = {
    (6, 0): (9, 0), (6, 1): (9, 1), (6, 2): (9, 2), (6, 3): (10, 0), (6, 4): (10, 1),
    (6, 5): (10, 2),
    **{(7, m): (11, m) for m in range(9)},  # 7.0 .. 7.8: CUDA 11.0 .. 11.8
    **{(8, m): (12, m) for m in range(6)},  # 8.0 .. 8.5: CUDA 12.0 .. 12.5
    (8, 6): (12, 7), (8, 7): (12, 8), (8, 8): (12, 9), (9, 0): (13, 0),
}
# The first driver branch of each CUDA version, for the advice.
DRIVER_BRANCH: dict[tuple[int, int], str] = {
    (11, 0): "R450", (11, 1): "R455", (11, 2): "R460", (11, 3): "R465", (11, 4): "R470",
    (11, 5): "R495", (11, 6): "R510", (11, 7): "R515", (11, 8): "R520", (12, 0): "R525",
    (12, 1): "R530", (12, 2): "R535", (12, 3): "R545", (12, 4): "R550", (12, 5): "R555",
    (12, 6): "R560", (12, 8): "R570", (12, 9): "R575", (13, 0): "R580",
}
# The toolkit kgen builds with; its cubins load on drivers of this major version on.
BUILT_WITH = (11, 8)
SASS_MIN_DRIVER = (11, 0)
KEPLER_LAST_DRIVER = (11, 4)  # R470, the last branch that supports compute 3.x


class UnloadableError(ValueError):
    """No image of the module can be loaded on this GPU with this driver."""


@dataclass(frozen=True)
class Device:
    """What decides the load: the GPU's compute capability and the driver's CUDA
    version (``name`` and ``driver_release`` only make the messages concrete)."""

    cc: tuple[int, int]
    driver: tuple[int, int]
    name: str = "this GPU"
    driver_release: str = ""

    def __str__(self) -> str:
        rel = f"driver {self.driver_release}, " if self.driver_release else ""
        return f"{self.name} (compute {v(self.cc)}, {rel}CUDA {v(self.driver)})"


@dataclass(frozen=True)
class Image:
    """One loadable image: ``kind`` "sass" or "ptx", ``arch`` (3, 7) for sm_37 or
    compute_37, and for PTX its ISA version."""

    kind: str
    arch: tuple[int, int]
    isa: tuple[int, int] | None = None

    def __str__(self) -> str:
        sm = f"{self.arch[0]}{self.arch[1]}"
        return f"sm_{sm} SASS" if self.kind == "sass" else \
            f"compute_{sm} PTX (ISA {v(self.isa or (0, 0))})"

    def needs(self) -> str:
        """What this image needs to load, in words."""
        if self.kind == "sass":
            return f"compute {v(self.arch)} GPU, driver {cuda(SASS_MIN_DRIVER)} or newer"
        need = PTX_ISA_CUDA.get(self.isa or (0, 0))
        drv = f"driver {cuda(need)} or newer" if need else "a driver that knows its ISA"
        return f"compute >= {v(self.arch)} GPU, {drv}"


@dataclass(frozen=True)
class Decision:
    """``image``: the one the driver will load (None: none can); ``reason``: why, in
    one sentence; ``rejected``: each other image and why it does not load."""

    device: Device
    image: Image | None
    reason: str
    rejected: tuple[tuple[Image, str], ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.image is not None


def v(t: tuple[int, int]) -> str:
    return f"{t[0]}.{t[1]}"


def cuda(t: tuple[int, int]) -> str:
    """'CUDA 11.8 (R520+)'"""
    branch = DRIVER_BRANCH.get(t)
    return f"CUDA {v(t)}" + (f" ({branch}+)" if branch else "")


def cuda_version(n: int) -> tuple[int, int]:
    """cuDriverGetVersion's integer as (major, minor): 11040 -> (11, 4)."""
    return n // 1000, (n % 1000) // 10


def images(path: Path) -> tuple[Image, ...]:
    """The images a load artifact offers: a fatbin's entries, or a PTX file."""
    data = Path(path).read_bytes()
    if Path(path).suffix == ".ptx":
        es = (fatbin.ptx_entry(data.decode("utf-8", "replace")),)
    else:
        es = fatbin.entries(data)
    return tuple(Image(e.kind, e.cc, e.version if e.kind == "ptx" else None) for e in es)


def _sass(img: Image, dev: Device) -> str | None:
    """Why this SASS image does not load on ``dev`` (None: it does)."""
    if dev.cc[0] != img.arch[0] or dev.cc[1] < img.arch[1]:
        return (f"its {img} runs only on compute {v(img.arch)} GPUs"
                if img.arch[1] == 7 and img.arch[0] == 3 else
                f"its {img} runs only on compute {img.arch[0]}.x GPUs from {v(img.arch)} on")
    if dev.driver < SASS_MIN_DRIVER:
        return (f"its {img} (built by CUDA {v(BUILT_WITH)}) needs a driver of "
                f"{cuda(SASS_MIN_DRIVER)} or newer; this host's is CUDA {v(dev.driver)}")
    return None


def _ptx(img: Image, dev: Device) -> str | None:
    """Why this PTX image cannot be JIT-compiled on ``dev`` (None: it can)."""
    if dev.cc < img.arch:
        return f"its {img} needs a GPU of compute {v(img.arch)} or newer"
    need = PTX_ISA_CUDA.get(img.isa or (0, 0))
    if need is None:
        return f"its {img} has an ISA version kgen does not know the driver for"
    if dev.driver < need:
        return (f"its PTX (ISA {v(img.isa)}) needs a {cuda(need)} driver; this host's is "
                f"CUDA {v(dev.driver)}")
    return None


def why_not(img: Image, dev: Device) -> str | None:
    """Why ``img`` does not load on ``dev`` (None: it does)."""
    return (_sass if img.kind == "sass" else _ptx)(img, dev)


def decide(offered: tuple[Image, ...], dev: Device) -> Decision:
    """Which of ``offered`` the driver will load on ``dev``, and why (see the module
    docstring for the rules)."""
    if dev.cc[0] == 3 and dev.driver > KEPLER_LAST_DRIVER:
        reason = (f"a compute {v(dev.cc)} GPU is a Kepler GPU, and NVIDIA drivers newer than "
                  f"R470 (CUDA {v(KEPLER_LAST_DRIVER)}) do not support Kepler; this host's "
                  f"driver is CUDA {v(dev.driver)}")
        return Decision(dev, None, reason,
                        tuple((i, "the driver does not support this GPU") for i in offered))
    why = {img: why_not(img, dev) for img in offered}
    loadable = [i for i in offered if why[i] is None]
    pick = next((i for i in loadable if i.kind == "sass"), loadable[0] if loadable else None)
    if pick is None:
        return Decision(dev, None, "; ".join(w for w in why.values() if w) or
                        "it holds no image", tuple((i, w or "") for i, w in why.items()))
    if pick.kind == "sass":
        reason = (f"its {pick} runs natively on compute {v(dev.cc)} (the code `kgen verify` "
                  f"checked); a CUDA {v(dev.driver)} driver loads CUDA {v(BUILT_WITH)}-built "
                  f"cubins")
    else:
        reason = (f"its {pick} is JIT-compiled for compute {v(dev.cc)} by the CUDA "
                  f"{v(dev.driver)} driver (ISA {v(pick.isa)} needs CUDA "
                  f"{v(PTX_ISA_CUDA[pick.isa])} or newer)")
    return Decision(dev, pick, reason, tuple(
        (i, why[i] or "it would load too; the SASS is preferred") for i in offered if i != pick))


def advice(offered: tuple[Image, ...], dev: Device) -> str:
    """What to do so that something loads."""
    if dev.cc[0] == 3:
        if any(i.kind == "sass" and i.arch == dev.cc for i in offered):
            return (f"install the R470 driver (CUDA {v(KEPLER_LAST_DRIVER)}), the last for "
                    f"Kepler, with CuPy for CUDA 11 (pip install 'kgen[cuda11]'): the fatbin's "
                    f"sm_{dev.cc[0]}{dev.cc[1]} SASS then loads natively")
        return (f"kgen's kernels are built for {', '.join(map(str, offered))}; a compute "
                f"{v(dev.cc)} GPU can run none of them")
    ptx = [i for i in offered if i.kind == "ptx" and dev.cc >= i.arch and i.isa in PTX_ISA_CUDA]
    if ptx:
        need = min(PTX_ISA_CUDA[i.isa] for i in ptx)
        return (f"install an NVIDIA driver of {cuda(need)} or newer so it can JIT-compile the "
                f"PTX")
    return (f"kgen's kernels are built for {', '.join(map(str, offered))}; a compute "
            f"{v(dev.cc)} GPU can run none of them")


def message(what: str, offered: tuple[Image, ...], d: Decision) -> str:
    """The whole explanation, as UnloadableError says it."""
    return f"cannot load {what} on {d.device}: {d.reason}. To run it: {advice(offered, d.device)}."


def require(path: Path, dev: Device) -> Decision:
    """The decision for the artifact at ``path`` on ``dev``; UnloadableError (a
    ValueError) when nothing in it can load there."""
    offered = images(path)
    d = decide(offered, dev)
    if not d.ok:
        raise UnloadableError(message(Path(path).name, offered, d))
    return d


def cupy_device(cp, index: int) -> Device:
    """The current CuPy device as a Device (runtime queries only; nothing is loaded)."""
    props = cp.cuda.runtime.getDeviceProperties(index)
    name = props["name"]
    return Device(cc=(int(props["major"]), int(props["minor"])),
                  driver=cuda_version(cp.cuda.runtime.driverGetVersion()),
                  name=name.decode() if isinstance(name, bytes) else str(name),
                  driver_release=driver_release())


def driver_release() -> str:
    """The NVIDIA kernel driver's version (e.g. 470.256.02), or "" when unknown."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return ""
    for word in text.split():
        parts = word.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return word
    return ""
