"""Which spec files a command reads: named files, or every *.kspec of a named directory."""

from __future__ import annotations

from pathlib import Path

from kgen.errors import SourcePos, SpecError

SPEC_SUFFIX = ".kspec"


def spec_paths(inputs: list[Path]) -> list[Path]:
    """Spec files named directly or found (sorted) in named directories."""
    out: list[Path] = []
    for p in inputs:
        if p.is_dir():
            found = sorted(p.glob(f"*{SPEC_SUFFIX}"))
            if not found:
                raise SpecError(SourcePos(str(p), 1, 1), f"no *{SPEC_SUFFIX} files here")
            out += found
        else:
            out.append(p)
    return out
