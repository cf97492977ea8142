"""Replace an output directory in one step, or not at all.

The new tree is written beside the target and swapped in with renames, so a
failure at any point before the swap leaves the target exactly as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath


def _check_paths(target: Path, files: dict[str, bytes]) -> None:
    for rel in files:
        parts = PurePosixPath(rel).parts
        if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
            raise ValueError(f"replace_dir: {rel!r} is not a path inside {target}")


def _stage(target: Path, files: dict[str, bytes], keep: tuple[str, ...]) -> Path:
    """Write the new tree beside ``target``; returns its temporary directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{target.name}.new-", dir=target.parent))
    try:
        for rel, data in sorted(files.items()):
            p = new / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        for name in keep:
            src = target / name
            if src.exists() and not (new / name).exists():
                if src.is_dir():
                    shutil.copytree(src, new / name)
                else:
                    shutil.copy2(src, new / name)
        os.chmod(new, 0o755)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    return new


def replace_dirs(outputs: list[tuple[Path, dict[str, bytes]]],
                 keep: tuple[str, ...] = ()) -> None:
    """Replace several directories together: every new tree is written first, then
    all are swapped in; if any step fails, every target is restored as it was."""
    outputs = [(Path(t), f) for t, f in outputs]
    for target, files in outputs:
        _check_paths(target, files)
    staged: list[tuple[Path, Path]] = []
    try:
        for target, files in outputs:
            staged.append((target, _stage(target, files, keep)))
    except BaseException:
        for _, new in staged:
            shutil.rmtree(new, ignore_errors=True)
        raise
    swapped: list[tuple[Path, Path | None]] = []  # (target, where its old tree went)
    try:
        for target, new in staged:
            old = None
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.rmdir(old)
                os.rename(target, old)
            swapped.append((target, old))
            os.rename(new, target)
    except BaseException:
        for target, old in reversed(swapped):
            if old is None:
                shutil.rmtree(target, ignore_errors=True)
                continue
            if target.exists() and target.resolve() != old.resolve():
                shutil.rmtree(target, ignore_errors=True)
            os.rename(old, target)
        for _, new in staged:
            shutil.rmtree(new, ignore_errors=True)
        raise
    for _, old in swapped:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def replace_dir(target: Path, files: dict[str, bytes], keep: tuple[str, ...] = ()) -> None:
    """Make ``target`` hold exactly ``files`` (relative path -> bytes).

    Names in ``keep`` (top-level entries of the old directory) are carried over.
    """
    replace_dirs([(target, files)], keep)


def read_tree(root: Path) -> dict[str, bytes]:
    """Every file below ``root`` as relative path -> bytes (empty if absent)."""
    root = Path(root)
    if not root.is_dir():
        return {}
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }
