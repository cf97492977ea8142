"""Replace output directories together, in a way no crash can break.

The new trees are written beside their targets (``.<name>.new-*``). Then an intent
journal (``.<first target>.swap.json``, written atomically beside the first target)
names every target with its staged tree and the name its old tree moves to, and only
then do the renames run (target -> ``.<name>.old-*``, staged -> target, per target).

* An exception in this process undoes the renames done so far: the targets are as
  they were.
* A crash (a kill) at any point leaves either no journal (nothing was renamed yet:
  only staged trees remain, which ``recover`` removes) or a journal, which ``recover``
  replays: every staged tree was complete before the journal was written, so the swap
  is finished forward, and every target ends up new and in step with the others.

``recover`` runs at the start of every command that reads or writes the trees (under
``lock``, one process per output directory), and also removes stale ``.new-*`` /
``.old-*`` trees that killed builds left behind.

``KGEN_FAULT_AT=<point>`` (for tests) ends the process at a named point of the swap,
as a kill would: ``staged``, ``journal``, ``old-<i>``, ``new-<i>`` (after the i-th
target's rename), ``swapped``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

JOURNAL_SUFFIX = ".swap.json"
LOCK_SUFFIX = ".lock"
LOCK_WAIT_S = 600


def _fault(point: str) -> None:
    if os.environ.get("KGEN_FAULT_AT") == point:
        os._exit(97)  # no cleanup, no finally: what a kill leaves


def _check_paths(target: Path, files: dict[str, bytes]) -> None:
    for rel in files:
        parts = PurePosixPath(rel).parts
        if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
            raise ValueError(f"replace_dir: {rel!r} is not a path inside {target}")


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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


def journal_path(targets: list[Path]) -> Path:
    first = Path(targets[0])
    return first.parent / f".{first.name}{JOURNAL_SUFFIX}"


def _write_journal(path: Path, entries: list[dict]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"swap": entries}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def replace_dirs(outputs: list[tuple[Path, dict[str, bytes]]],
                 keep: tuple[str, ...] = ()) -> None:
    """Replace several directories together: every new tree is written first, then
    all are swapped in under a journal; if any step fails, every target is restored
    as it was, and a crash is finished by the next ``recover``."""
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
    _fault("staged")
    entries = []
    for target, new in staged:
        old = target.parent / f".{target.name}.old-{new.name.rsplit('-', 1)[-1]}"
        entries.append({"target": str(target), "new": str(new), "old": str(old)})
    journal = journal_path([t for t, _ in staged])
    swapped: list[dict] = []  # entries whose target moved aside (or was absent)
    try:
        _write_journal(journal, entries)
        _fault("journal")
        for i, e in enumerate(entries):
            target, new, old = Path(e["target"]), Path(e["new"]), Path(e["old"])
            had = target.exists()
            if had:
                os.rename(target, old)
            swapped.append({**e, "had": had})
            _fault(f"old-{i}")
            os.rename(new, target)
            swapped[-1]["done"] = True
            _fault(f"new-{i}")
    except BaseException:
        for e in reversed(swapped):  # undo, newest first
            target, new, old = Path(e["target"]), Path(e["new"]), Path(e["old"])
            if e.get("done"):
                os.rename(target, new)
            if e["had"]:
                os.rename(old, target)
        for _, new in staged:
            shutil.rmtree(new, ignore_errors=True)
        with contextlib.suppress(OSError):
            journal.unlink()
        raise
    _fault("swapped")
    journal.unlink()
    _fsync_dir(journal.parent)
    for e in entries:
        shutil.rmtree(e["old"], ignore_errors=True)


def replace_dir(target: Path, files: dict[str, bytes], keep: tuple[str, ...] = ()) -> None:
    """Make ``target`` hold exactly ``files`` (relative path -> bytes).

    Names in ``keep`` (top-level entries of the old directory) are carried over.
    """
    replace_dirs([(target, files)], keep)


def recover(targets: list[Path]) -> list[str]:
    """Finish a swap a crash interrupted (from its journal), then remove stale staged
    and old trees of ``targets``. Call it holding ``lock(targets)``. Returns what it
    did, for the progress line."""
    targets = [Path(t) for t in targets]
    done = []
    journal = journal_path(targets)
    try:
        entries = json.loads(journal.read_text(encoding="utf-8"))["swap"]
    except FileNotFoundError:
        entries = None
    except (OSError, ValueError, KeyError, TypeError):
        entries = None  # unreadable: written by no complete _write_journal; nothing renamed
        journal.unlink()
    if entries is not None:
        for e in entries:
            target, new, old = Path(e["target"]), Path(e["new"]), Path(e["old"])
            if new.exists():  # not swapped in yet: finish it
                if target.exists():
                    if old.exists():
                        shutil.rmtree(target)  # cannot happen with one swapper; be safe
                    else:
                        os.rename(target, old)
                os.rename(new, target)
        journal.unlink()
        _fsync_dir(journal.parent)
        done.append(f"finished an interrupted swap of {', '.join(e['target'] for e in entries)}")
    for target in targets:
        if not target.parent.is_dir():
            continue
        for p in target.parent.glob(f".{target.name}.*"):
            if p.is_dir() and (".new-" in p.name or ".old-" in p.name):
                shutil.rmtree(p, ignore_errors=True)
                done.append(f"removed {p}")
            elif p.name.startswith(f".{target.name}{JOURNAL_SUFFIX}.") and p.suffix == ".tmp":
                p.unlink(missing_ok=True)
    return done


@contextlib.contextmanager
def lock(targets: list[Path], waiting=None, required: bool = True) -> Iterator[None]:
    """One process at a time per output directory: ``.<name>.lock`` beside each target,
    taken in a fixed order. ``waiting(msg)`` is told when another process holds one.
    Not ``required`` (a read-only check): a lock that cannot be created is skipped."""
    from filelock import FileLock, Timeout

    paths = sorted({os.path.realpath(Path(t).parent / f".{Path(t).name}{LOCK_SUFFIX}")
                    for t in targets})
    with contextlib.ExitStack() as stack:
        for p in paths:
            fl = FileLock(p)
            try:
                Path(p).parent.mkdir(parents=True, exist_ok=True)
                fl.acquire(timeout=0)
            except Timeout:  # (a TimeoutError, so an OSError: caught first)
                if waiting:
                    waiting(f"waiting for another kgen process ({p})")
                try:
                    fl.acquire(timeout=LOCK_WAIT_S)
                except Timeout:
                    from kgen.errors import KgenError

                    raise KgenError(f"another kgen process has held {p} for {LOCK_WAIT_S} s"
                                    ) from None
            stack.callback(fl.release)
        yield


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
