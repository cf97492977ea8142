"""``kgen golden``: the reference compiled once, kernel by kernel, into golden/.

golden/ holds the reference's whole PTX module (what ``verify`` compares PTX
entries against), each kernel's SASS listing and each kernel's resources, plus
a manifest naming the reference's hash and the toolchain that made it. It is
committed, so verifying needs the toolchain but not the reference source.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kgen import __version__
from kgen.errors import KgenError
from kgen.toolchain import ptx_entries, resources, sass_listing
from kgen.toolchain.cache import sha256

PTX_FILE = "attention.ptx"
FROZEN_FILE = "frozen.json"  # `kgen freeze`: a snapshot of every generated kernel beyond
#                              the reference (its code digest, PTX digest and resources)
RESOURCES_FILE = "resources.json"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class Golden:
    """The golden as verify reads it."""

    ptx: dict[str, str]
    sass: dict[str, tuple[sass_listing.Instr, ...]]
    resources: dict[str, resources.Resources]
    manifest: dict
    frozen: dict[str, dict] = field(default_factory=dict)  # kernel -> snapshot (frozen.json)

    @property
    def kernels(self) -> list[str]:
        return sorted(self.ptx)


def golden_files(reference_name: str, source: str, ptx_text: str, ptxas_log: str,
                 listing: dict[str, tuple[sass_listing.Instr, ...]],
                 versions: dict[str, str]) -> dict[str, bytes]:
    """The exact contents of golden/ for the reference compiled to ``ptx_text``,
    ptxas's report ``ptxas_log`` and the SASS ``listing`` (the ``golden`` stage)."""
    res = resources.parse(ptxas_log)
    names = sorted(ptx_entries.entries(ptx_text))
    files = {PTX_FILE: ptx_text.encode()}
    for name in names:
        files[f"sass/{name}.sass"] = sass_listing.render(listing[name]).encode()
    files[RESOURCES_FILE] = (
        json.dumps({n: res[n].as_dict() for n in names}, indent=2, sort_keys=True) + "\n"
    ).encode()
    manifest = {
        "reference": reference_name,
        "reference_sha256": sha256(source.encode()),
        "toolchain": versions,
        "kgen_version": __version__,
        "kernels": names,
    }
    files[MANIFEST_FILE] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    return files


def golden_kernels(files: dict[str, bytes]) -> list[str]:
    """The kernel names a golden tree (as ``golden_files`` made it) holds."""
    return json.loads(files[MANIFEST_FILE])["kernels"]


def load_golden(golden_dir: Path) -> Golden:
    try:
        ptx_text = (golden_dir / PTX_FILE).read_text(encoding="utf-8")
        res = json.loads((golden_dir / RESOURCES_FILE).read_text(encoding="utf-8"))
        manifest = json.loads((golden_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KgenError(f"no usable golden in {golden_dir} ({exc}); run `kgen golden`") from None
    ptx = ptx_entries.entries(ptx_text)
    sass = {}
    for name in ptx:
        path = golden_dir / "sass" / f"{name}.sass"
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise KgenError(f"golden is incomplete: {path} ({exc.strerror}); run `kgen golden`"
                            ) from None
        sass[name] = _parse_rendered(text)
    return Golden(
        ptx=ptx,
        sass=sass,
        resources={n: resources.Resources(**r) for n, r in res.items()},
        manifest=manifest,
        frozen=load_frozen(golden_dir),
    )


def load_frozen(golden_dir: Path) -> dict[str, dict]:
    """The frozen snapshots (none before the first ``kgen freeze``)."""
    path = golden_dir / FROZEN_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise KgenError(f"unreadable {path} ({exc}); restore it from git or run `kgen freeze`"
                        ) from None
    kernels = data.get("kernels") if isinstance(data, dict) else None
    if not isinstance(kernels, dict):
        raise KgenError(f"{path} has no 'kernels' table; restore it from git or run "
                        "`kgen freeze`")
    return kernels


def snapshot(c) -> dict:
    """What ``kgen freeze`` records of one compiled kernel (a verify.Compiled)."""
    return {
        "module": c.module,
        "code_sha256": sha256(c.code),
        "code_bytes": len(c.code),
        "ptx_sha256": sha256(c.ptx.encode()),
        "resources": c.resources.as_dict(),
    }


def frozen_file(kernels: dict[str, dict], versions: dict[str, str]) -> bytes:
    """golden/frozen.json: one entry per kernel, sorted, so a review reads the change."""
    doc = {"about": "kgen freeze: each generated kernel beyond the reference, as `kgen "
                    "verify` checks it (cubin .text digest, PTX entry digest, resources)",
           "toolchain": versions, "kernels": kernels}
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def _parse_rendered(text: str) -> tuple[sass_listing.Instr, ...]:
    """Read back what sass_listing.render wrote."""
    return sass_listing.parse("Function : k\n" + text)["k"]
