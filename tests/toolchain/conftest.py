"""Fixtures of the toolchain tier: isolated settings, a scratch copy of the repo.

Every test runs with KGEN_* settings pointing into its own tmp_path, so nothing
here writes the repo's generated/ or golden/ or the user's cache. Tests that
are not about the cache share one session cache, seeded with a copy of the store
the repo's build filled, so builds compile only the kernels a test changes.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tc_helpers import OUTPUT_KEYS, REPO, SETTINGS_ENV, Workspace, scratch_settings

from kgen.config import DEFAULTS, Settings
from kgen.toolchain.locate import find_toolchain


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """A copy of the store the repo's own build filled (make build runs before the
    tests), so builds of unchanged kernels are hits and only what a test changes
    compiles; entries in the middle of a write (dot names) are left behind. Empty
    where no build ran. Tests write this copy, never the user's store."""
    root = tmp_path_factory.mktemp("kgen-cache")
    store = Settings.load(REPO).cache_dir
    if store.is_dir():
        shutil.copytree(store, root, dirs_exist_ok=True, symlinks=True,
                        ignore=shutil.ignore_patterns(".*"))
    return root


@pytest.fixture(scope="session")
def tc():
    return find_toolchain()


@pytest.fixture
def clean_env(monkeypatch, tmp_path, session_cache):
    """No inherited KGEN_* settings; every output kgen may write under tmp_path;
    the shared session cache; tool work dirs (kept when a tool fails) under
    tmp_path instead of /tmp."""
    for key in SETTINGS_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in scratch_settings(tmp_path / "scratch").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KGEN_CACHE_DIR", str(session_cache))
    work = tmp_path / "tmpdir"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    return work


@pytest.fixture
def ws(tmp_path, monkeypatch, clean_env, session_cache) -> Iterator[Workspace]:
    # The workspace is a kgen project of its own (cwd + pyproject), so spec
    # paths render as in the repo ("specs/util.kspec") and unmutated modules
    # hit the session cache.
    root = tmp_path / "ws"
    root.mkdir()
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    monkeypatch.chdir(root)
    monkeypatch.setenv("KGEN_REFERENCE", str((REPO / DEFAULTS["reference"]).resolve()))
    paths = {}
    for name in ("specs", "templates", "golden", "generated"):
        shutil.copytree(REPO / name, root / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
        monkeypatch.setenv(f"KGEN_{name.upper()}", str(root / name))
        paths[name] = root / name
    yield Workspace(root=root, cache=session_cache, **paths)
    # Outputs rendered from the scratch specs name them by their tmp path: none
    # may have reached the repo's own output directories.
    leaked = [str(p) for key in OUTPUT_KEYS for p in (REPO / DEFAULTS[key]).rglob("*")
              if p.is_file() and str(root).encode() in p.read_bytes()]
    assert not leaked, f"a test wrote into the repo: {leaked}"
