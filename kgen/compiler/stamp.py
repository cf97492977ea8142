"""The no-op rebuild: skip a build whose inputs and outputs are unchanged.

A build's *input digest* covers everything that can change its output: kgen's
version and source files, every spec and template file, and the identity
(path, size, mtime) of the toolchain binaries. After a build, the digest is
recorded in the cache with the sha256 of every output file. A later build with
the same digest whose outputs on disk still hash the same has nothing to do.
Nothing is trusted by path alone: inputs and outputs are hashed every time.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from kgen import __version__

KGEN_SRC = Path(__file__).resolve().parents[1]  # every module of kgen


def _files(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.rglob(pattern) if p.is_file() and "__pycache__" not in p.parts)


def _read(p: Path) -> bytes:
    """A regular file's bytes; OSError for anything else (a FIFO would block)."""
    if not stat.S_ISREG(os.stat(p).st_mode):
        raise OSError(f"{p}: not a regular file")
    return p.read_bytes()


def _tool_identity() -> list[str]:
    from kgen.toolchain.locate import _layouts, _resolve

    out = []
    for layout in _layouts():
        tools = _resolve(layout)
        if tools:
            for t, p in sorted(tools.items()):
                st = os.stat(p)
                out.append(f"{t}={p}:{st.st_size}:{st.st_mtime_ns}")
            break
    return out


def input_digest(spec_files: list[Path], templates: Path, named: list[str] = ()) -> str:
    """``spec_files``: every spec the build may read (the named ones and those beside
    them); ``named``: what the command named (a build of one file writes other outputs
    than a build of its directory)."""
    h = hashlib.sha256(f"kgen {__version__}\n".encode())
    for n in named:
        h.update(f"named:{n}\n".encode())
    groups = (("spec", spec_files), ("template", _files(templates, "*")),
              ("kgen", _files(KGEN_SRC, "*.py") + _files(KGEN_SRC, "*.lark")))
    for kind, files in groups:
        for p in files:
            h.update(f"{kind}:{p.name}:{hashlib.sha256(_read(p)).hexdigest()}\n".encode())
    for line in _tool_identity():
        h.update(line.encode())
    return h.hexdigest()


def _outputs(dirs: list[Path]) -> dict[str, str]:
    out = {}
    for d in dirs:
        for p in _files(d, "*"):
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _record_path(cache_dir: Path, digest: str) -> Path:
    return cache_dir / "builds" / f"{digest}.json"


def is_fresh(cache_dir: Path, digest: str, dirs: list[Path]) -> bool:
    try:
        recorded = json.loads(_record_path(cache_dir, digest).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return recorded == _outputs(dirs)


def record(cache_dir: Path, digest: str, dirs: list[Path]) -> None:
    path = _record_path(cache_dir, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_outputs(dirs), sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)
