"""Settings: where the reference, specs, templates and outputs live.

Precedence: environment variable, then ``[tool.kgen]`` in the project's
pyproject.toml, then the built-in default. Paths in pyproject.toml are relative
to the directory that holds it.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULTS = {
    "reference": "../shared/reference/attention.cu",
    "specs": "specs",
    "templates": "templates",
    "generated": "generated",
    "golden": "golden",
}


def find_root(start: Path | None = None) -> Path:
    """The nearest directory at or above ``start`` whose pyproject names kgen."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        pp = d / "pyproject.toml"
        if pp.is_file() and "[tool.kgen]" in pp.read_text(encoding="utf-8"):
            return d
    return Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Settings:
    root: Path
    reference: Path
    specs: Path
    templates: Path
    generated: Path
    golden: Path
    cache_dir: Path
    # Modules whose fatbins the C header embeds (None: every module). The others are
    # loaded from their .fatbin files; embedding every variant would make a header of
    # tens of megabytes.
    c_header_modules: tuple[str, ...] | None = None

    @classmethod
    def load(cls, root: Path | None = None) -> Settings:
        root = find_root(root)
        table: dict[str, str] = {}
        pp = root / "pyproject.toml"
        if pp.is_file():
            table = tomllib.loads(pp.read_text(encoding="utf-8")).get("tool", {}).get("kgen", {})

        def path(key: str) -> Path:
            env = os.environ.get(f"KGEN_{key.upper()}")
            raw = env if env else table.get(key, DEFAULTS[key])
            p = Path(raw)
            return p if p.is_absolute() else (root / p)

        cache = os.environ.get("KGEN_CACHE_DIR") or str(
            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kgen"
        )
        return cls(
            root=root,
            reference=path("reference"),
            specs=path("specs"),
            templates=path("templates"),
            generated=path("generated"),
            golden=path("golden"),
            cache_dir=Path(cache),
            c_header_modules=(tuple(table["c_header_modules"])
                              if "c_header_modules" in table else None),
        )
