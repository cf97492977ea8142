"""Replace an output directory in one step, or not at all.

The new tree is written beside the target and swapped in with renames, so a
failure at any point before the swap leaves the target exactly as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath


def replace_dir(target: Path, files: dict[str, bytes], keep: tuple[str, ...] = ()) -> None:
    """Make ``target`` hold exactly ``files`` (relative path -> bytes).

    Names in ``keep`` (top-level entries of the old directory) are carried over.
    """
    target = Path(target)
    for rel in files:
        parts = PurePosixPath(rel).parts
        if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
            raise ValueError(f"replace_dir: {rel!r} is not a path inside {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{target.name}.new-", dir=target.parent))
    old = None
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
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rmdir(old)
            os.rename(target, old)
        os.rename(new, target)
    except BaseException:
        if old is not None and not target.exists():
            os.rename(old, target)
            old = None
        shutil.rmtree(new, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
