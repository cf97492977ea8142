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
from pathlib import Path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Cache:
    def __init__(self, root: Path, enabled: bool = True):
        self.root = root
        self.enabled = enabled

    def _dir(self, key: str) -> Path:
        return self.root / key[:2] / key

    def get(self, key: str) -> dict[str, bytes] | None:
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
            return files
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, files: dict[str, bytes]) -> None:
        if not self.enabled:
            return
        d = self._dir(key)
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key[:8]}-", dir=d.parent))
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            manifest = {"key": key, "files": {n: sha256(b) for n, b in files.items()}}
            (tmp / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
            if d.exists():
                # A damaged or stale entry: move it aside, then claim the name.
                shutil.rmtree(d, ignore_errors=True)
            try:
                os.rename(tmp, d)
            except OSError:
                # Another builder won the race with an identical entry.
                pass
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
