"""Which spec files a command reads: named files, or every *.kspec of a named directory."""

from __future__ import annotations

import os
from pathlib import Path

from kgen.errors import SourcePos, SpecError

SPEC_SUFFIX = ".kspec"


def spec_paths(inputs: list[Path]) -> list[Path]:
    """Spec files named directly or found (sorted) in named directories; a file named
    twice (``specs/a.kspec ./specs/a.kspec``, or a file and its directory) is read once."""
    out: list[Path] = []
    seen: set[str] = set()
    for p in inputs:
        if p.is_dir():
            found = sorted(p.glob(f"*{SPEC_SUFFIX}"))
            if not found:
                raise SpecError(SourcePos(str(p), 1, 1), f"no *{SPEC_SUFFIX} files here")
        else:
            found = [p]
        for f in found:
            if os.path.realpath(f) not in seen:
                seen.add(os.path.realpath(f))
                out.append(f)
    return out
