"""The build's manifest (``generated/manifest.json``): the one home of its layout.

``kgen build`` writes it (kgen.compiler.pipeline, through ``dump``); everything else
reads it through ``read``: the launcher factory (kgen.runtime.kernels), ``kgen doctor``,
the tuner, the wheel. One entry per kernel holds what a host needs to launch it
without the compiler: its module, its axes (the kernel record the launch contracts
read), its launcher's arguments, its fatbin and the source it was compiled from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 2  # the layout's version; a manifest of another layout is refused by read
KERNELS_DIR = "kernels"  # <kernel>.fatbin: sm_37 SASS + PTX, one load artifact a kernel
SOURCES_DIR = "src"  # <kernel>.cu: the translation unit the kernel was compiled from


class ManifestError(ValueError):
    """No readable manifest of this layout where one was looked for."""


@dataclass(frozen=True)
class Arg:
    """One launcher argument: arrays are positional (``dtype`` the NumPy dtype the
    kernel reads), scalars keyword-only with a Python literal as ``default``."""

    name: str
    annotation: str
    default: str | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class Entry:
    name: str
    module: str
    spec: str
    doc: str
    axes: dict
    arrays: tuple[Arg, ...]
    scalars: tuple[Arg, ...]
    fatbin: str  # relative to the manifest's directory
    fatbin_sha256: str
    source: str
    source_sha256: str
    resources: dict  # ptxas's report: registers, stack_frame, spills, static_smem
    relations: tuple[dict, ...] = ()  # the spec's `expect <kind> with <other>`: kind, other,
    #                                   tolerance (the kernel tests check them on the GPU)


@dataclass(frozen=True)
class Manifest:
    root: Path  # the directory the manifest's paths are relative to
    generator: str
    toolchain: dict
    kernels: dict[str, Entry]  # in module order, then spec order
    c_header: str
    c_header_modules: tuple[str, ...]

    @property
    def modules(self) -> dict[str, list[Entry]]:
        out: dict[str, list[Entry]] = {}
        for e in self.kernels.values():
            out.setdefault(e.module, []).append(e)
        return out

    def fatbin(self, kernel: str) -> Path:
        return self.root / self.kernels[kernel].fatbin


def _args(rows) -> tuple[Arg, ...]:
    return tuple(Arg(**r) for r in rows)


def read(directory: Path) -> Manifest:
    """The manifest in ``directory``; ManifestError when there is none of this layout."""
    path = Path(directory) / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ManifestError(f"no readable {path} ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ManifestError(f"{path} is not a kgen manifest of format {FORMAT} (rebuild "
                            "with `kgen build specs/`)")
    try:
        kernels = {
            name: Entry(name=name, module=e["module"], spec=e["spec"], doc=e["doc"],
                        axes=dict(e["axes"]), arrays=_args(e["arrays"]),
                        scalars=_args(e["scalars"]), fatbin=e["fatbin"],
                        fatbin_sha256=e["fatbin_sha256"], source=e["source"],
                        source_sha256=e["source_sha256"], resources=dict(e["resources"]),
                        relations=tuple(dict(r) for r in e["relations"]))
            for name, e in data["kernels"].items()
        }
        return Manifest(Path(directory), data["generator"], dict(data["toolchain"]), kernels,
                        data["c_header"]["file"], tuple(data["c_header"]["modules"]))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ManifestError(f"{path} is damaged ({type(exc).__name__}: {exc}); rebuild with "
                            "`kgen build specs/`") from None


def dump(m: Manifest) -> bytes:
    """The manifest's file, byte-identical for the same contents."""
    def args(rows: tuple[Arg, ...]) -> list[dict]:
        return [{k: v for k, v in a.__dict__.items()} for a in rows]

    data = {
        "format": FORMAT,
        "generator": m.generator,
        "toolchain": m.toolchain,
        "c_header": {"file": m.c_header, "modules": list(m.c_header_modules)},
        "kernels": {
            e.name: {"module": e.module, "spec": e.spec, "doc": e.doc, "axes": e.axes,
                     "arrays": args(e.arrays), "scalars": args(e.scalars),
                     "fatbin": e.fatbin, "fatbin_sha256": e.fatbin_sha256,
                     "source": e.source, "source_sha256": e.source_sha256,
                     "resources": e.resources, "relations": list(e.relations)}
            for e in m.kernels.values()
        },
    }
    # Kernels keep their order (modules by name, spec order within); keys inside sort.
    body = json.dumps(data, indent=1, sort_keys=False)
    return (body + "\n").encode()
