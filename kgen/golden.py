"""``kgen golden``: the reference compiled once, kernel by kernel, into golden/.

golden/ holds the reference's whole PTX module (what ``verify`` compares PTX
entries against), each kernel's SASS listing and each kernel's resources, plus
a manifest naming the reference's hash and the toolchain that made it. It is
committed, so verifying needs the toolchain but not the reference source.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kgen import __version__, compile, ptx_entries, resources, sass_listing
from kgen.atomic import replace_dir
from kgen.cache import Cache, sha256
from kgen.errors import KgenError
from kgen.toolchain import Toolchain

PTX_FILE = "attention.ptx"
RESOURCES_FILE = "resources.json"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class Golden:
    """The golden as verify reads it."""

    ptx: dict[str, str]
    sass: dict[str, tuple[sass_listing.Instr, ...]]
    resources: dict[str, resources.Resources]
    manifest: dict

    @property
    def kernels(self) -> list[str]:
        return sorted(self.ptx)


def make_golden(reference: Path, golden_dir: Path, tc: Toolchain, cache: Cache) -> list[str]:
    """Compile the reference and replace golden/ with the result; returns kernel names."""
    if not reference.is_file():
        raise KgenError(
            f"reference not found: {reference} (set KGEN_REFERENCE or [tool.kgen] reference)"
        )
    source = reference.read_text(encoding="utf-8")
    ptx_text = compile.ptx(source, tc, cache, name="attention")
    cub = compile.cubin(ptx_text, tc, cache, name="attention")
    listing = sass_listing.parse(compile.sass(cub.data, tc, cache, name="attention"))
    res = resources.parse(cub.ptxas_log)
    names = sorted(ptx_entries.entries(ptx_text))
    files = {PTX_FILE: ptx_text.encode()}
    for name in names:
        files[f"sass/{name}.sass"] = sass_listing.render(listing[name]).encode()
    files[RESOURCES_FILE] = (
        json.dumps({n: res[n].as_dict() for n in names}, indent=2, sort_keys=True) + "\n"
    ).encode()
    manifest = {
        "reference": reference.name,
        "reference_sha256": sha256(source.encode()),
        "toolchain": dict(tc.versions),
        "kgen_version": __version__,
        "kernels": names,
    }
    files[MANIFEST_FILE] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    replace_dir(golden_dir, files)
    return names


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
    )


def _parse_rendered(text: str) -> tuple[sass_listing.Instr, ...]:
    """Read back what sass_listing.render wrote."""
    return sass_listing.parse("Function : k\n" + text)["k"]
