"""A content-addressed cache for compiled artifacts.

An entry lives at ``<cache>/<key[:2]>/<key>/`` and holds the artifact files
plus ``manifest.json`` with each file's sha256. An entry is used only when its
manifest and every file's hash check out; anything else is treated as a miss
and rebuilt. Entries are written into a private temporary directory and
renamed into place, so concurrent builders never see a half-written entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Cache:
    def __init__(self, root: Path, enabled: bool = True):
        self.root = root
        self.enabled = enabled

    def disabled(self) -> Cache:
        """The same store, neither read nor written (a batch whose parts are stored)."""
        return Cache(self.root, enabled=False)

    def _dir(self, key: str) -> Path:
        return self.root / key[:2] / key

    def get(self, key: str, expect: Iterable[str] = ()) -> dict[str, bytes] | None:
        """The entry's files, or None unless the entry is whole and holds ``expect``."""
        if not self.enabled:
            return None
        d = self._dir(key)
        try:
            manifest = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
            if manifest.get("key") != key:
                return None
            files = {}
            for name, digest in manifest["files"].items():
                data = (d / name).read_bytes()
                if sha256(data) != digest:
                    return None
                files[name] = data
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            # AttributeError: a manifest that is JSON but not the expected shape.
            return None
        if not set(expect) <= files.keys():
            return None
        return files

    def put(self, key: str, files: dict[str, bytes]) -> None:
        if not self.enabled:
            return
        d = self._dir(key)
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key[:8]}-", dir=d.parent))
        trash = None
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            manifest = {"key": key, "files": {n: sha256(b) for n, b in files.items()}}
            (tmp / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
            try:
                os.rename(tmp, d)
                return
            except OSError:
                pass  # the name is taken
            if self.get(key, files) is not None:
                return  # another builder stored the same entry first; keep it
            # A damaged or stale entry: move it aside in one rename (readers see
            # either it or nothing), then claim the name.
            trash = Path(tempfile.mkdtemp(prefix=f".{key[:8]}-old-", dir=d.parent))
            try:
                os.rename(d, trash)
                os.rename(tmp, d)
            except OSError:
                pass  # another builder replaced it meanwhile; a later get checks it
        finally:
            for t in (tmp, trash):
                if t is not None and t.exists():
                    shutil.rmtree(t, ignore_errors=True)
