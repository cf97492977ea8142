"""The launcher factory: ``kgen_kernels`` built from a manifest, at import.

One function per kernel, grouped in one module per spec ``module``
(``kgen_kernels.attn_decode``), each made from the manifest's entry: its arrays
positional, its scalars keyword-only with their defaults, then ``stream``. A launcher
checks dtypes, shapes, contiguity, device and every kernel contract
(kgen.runtime.bind), then launches the kernel's fatbin through CuPy; a violation
raises kgen.runtime.ContractError (a ValueError) before the GPU is touched.

Where the artifacts come from, first found wins: ``KGEN_GENERATED`` (a directory
holding a manifest), the ``kgen_kernels`` package's own directory (an installed
wheel, ``make dist``), then the checkout's ``generated/`` (``kgen build``). With none
of them, importing ``kgen_kernels`` raises ImportError saying what to run.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import types
from pathlib import Path

from kgen.runtime.launch import launch
from kgen.runtime.manifest import Entry, Manifest, ManifestError, read
from kgen.runtime.record import kernel

PACKAGE = "kgen_kernels"
CHECKOUT = Path(__file__).resolve().parents[2] / "generated"  # where `kgen build` writes


def installed_dir() -> Path | None:
    """The directory of the importable ``kgen_kernels`` package (its source in a
    checkout, or an installed wheel with its artifacts), found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def candidates(package_dir: Path | None = None) -> list[Path]:
    """The directories looked in for a manifest, in order."""
    out = []
    env = os.environ.get("KGEN_GENERATED")
    if env:
        out.append(Path(env).resolve())
    if package_dir is not None:
        out.append(Path(package_dir).resolve())
    out.append(CHECKOUT)
    return out


def locate(package_dir: Path | None = None, directory: Path | None = None) -> Manifest:
    """The first manifest found (only ``directory``'s when given); ImportError (what to
    run) when there is none."""
    tried = []
    for d in [Path(directory)] if directory is not None else candidates(package_dir):
        try:
            return read(d)
        except ManifestError as exc:
            tried.append(str(exc))
    raise ImportError(
        "no built kernels: " + "; ".join(tried) + ". Build them with `make build` (or "
        "`kgen build specs/`) in a kgen checkout with the CUDA 11.8 toolchain, or install "
        "a kgen wheel with its kernels (`make dist` on such a machine, then `pip install "
        "dist/kgen-*.whl` here); KGEN_GENERATED names another built tree.", name=PACKAGE)


def _literal(text: str | None) -> str:
    """A scalar's default as Python source, refused unless it is a plain literal."""
    if text is None:
        return ""
    ast.literal_eval(text)  # raises on anything but a literal
    return " = " + text


def launcher_source(e: Entry) -> str:
    """The Python source of one launcher (names are identifiers the spec checks
    admitted; defaults are literals, checked again here)."""
    for n in (e.name, *(a.name for a in (*e.arrays, *e.scalars))):
        if not n.isidentifier():
            raise ManifestError(f"{e.name}: '{n}' is no identifier")
    params = [a.name for a in e.arrays]
    params += ["*"] + [f"{s.name}{_literal(s.default)}" for s in e.scalars] + ["stream=None"]
    values = [a.name for a in (*e.arrays, *e.scalars)]
    names = "".join(f"{n!r}, " for n in values)
    return (f"def {e.name}({', '.join(params)}):\n"
            f"    return _launch(_K, _FATBIN, ({''.join(v + ', ' for v in values)}), "
            f"stream, ({names}))\n")


def _doc(e: Entry) -> str:
    arrays = ", ".join(a.name for a in e.arrays)
    dtypes = "/".join(dict.fromkeys(a.dtype for a in e.arrays if a.dtype))
    doc = e.doc[:1].upper() + e.doc[1:]
    return (f"{doc}.\n\nArrays ({arrays}): C-contiguous CuPy arrays of dtype {dtypes} as the "
            "kernel reads them.\nReturns the bound kgen.runtime.Launch (grid, block, shared "
            f"memory, arguments).\n[{e.spec}; launcher made by kgen.runtime.kernels]")


def make_launcher(e: Entry, fatbin: Path, module: str):
    record = kernel(e.name, e.axes, e.resources)
    scope = {"_launch": launch, "_K": record, "_FATBIN": fatbin}
    exec(compile(launcher_source(e), f"<kgen launcher {e.name}>", "exec"), scope)
    fn = scope[e.name]
    fn.__module__ = module
    fn.__qualname__ = e.name
    fn.__doc__ = _doc(e)
    fn.kernel = record  # the kernel record its contracts read (axes and registers)
    fn.fatbin = fatbin  # the load artifact it launches
    return fn


def build_package(m: Manifest, package: str = PACKAGE) -> dict[str, types.ModuleType]:
    """``{module name: module}``: each holds its launchers, ``KERNELS`` (name ->
    kernel record) and ``FATBINS`` (name -> fatbin path)."""
    out = {}
    for name, entries in m.modules.items():
        mod = types.ModuleType(f"{package}.{name}", f"Launchers of the {name} kernels "
                               f"({', '.join(sorted({e.spec for e in entries}))}).")
        mod.KERNELS, mod.FATBINS = {}, {}
        for e in entries:
            fn = make_launcher(e, m.fatbin(e.name), mod.__name__)
            setattr(mod, e.name, fn)
            mod.KERNELS[e.name] = fn.kernel
            mod.FATBINS[e.name] = fn.fatbin
        out[name] = mod
    return out


def expose(namespace: dict, package_dir: Path | None = None,
           directory: Path | None = None) -> None:
    """Fill the ``kgen_kernels`` package's namespace: ``MANIFEST``, ``MODULES``, every
    module (also importable as ``kgen_kernels.<module>``) and every launcher."""
    package = namespace["__name__"]
    m = locate(package_dir, directory)
    mods = build_package(m, package)
    for name, mod in mods.items():
        sys.modules[mod.__name__] = mod
        namespace[name] = mod
        for k in mod.KERNELS:
            namespace[k] = getattr(mod, k)
    namespace["MANIFEST"] = m
    namespace["ROOT"] = m.root
    namespace["MODULES"] = mods
    namespace["__all__"] = ["MANIFEST", "MODULES", "ROOT", *mods,
                            *(k for mod in mods.values() for k in mod.KERNELS)]
