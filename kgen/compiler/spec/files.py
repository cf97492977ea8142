"""Which spec files a command reads: named files, or every *.kspec of a named directory."""

from __future__ import annotations

import os
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


def partial(inputs: list[Path] | tuple[Path, ...]) -> bool:
    """True when ``inputs`` name some spec files of a directory but not all of them."""
    named = {os.path.realpath(p) for p in spec_paths(list(inputs))}
    beside = {os.path.realpath(s) for p in named for s in Path(p).parent.glob(f"*{SPEC_SUFFIX}")}
    return bool(beside - named)
