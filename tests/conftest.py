"""Test tiers and the one GPU marker.

Tiers: pure Python (no marker), ``toolchain`` (needs CUDA 11.8: compile, SASS,
no GPU) and ``gpu`` (needs a CUDA device and CuPy). A tier whose requirement is
missing is skipped with the reason; the markers are declared in pyproject.toml.
"""

from __future__ import annotations

from functools import cache

import pytest

from kgen.runtime.package import ensure_kgen_kernels

ensure_kgen_kernels()


@cache
def gpu_unavailable() -> str | None:
    """Why GPU tests cannot run here, or None when they can."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return f"CuPy not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no CUDA device ({type(exc).__name__})"
    return None if n > 0 else "no CUDA device"


@cache
def toolchain_unavailable() -> str | None:
    from kgen.errors import ToolchainError
    from kgen.toolchain.locate import find_toolchain

    try:
        find_toolchain()
    except ToolchainError as exc:
        return str(exc)
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and (why := gpu_unavailable()):
            item.add_marker(pytest.mark.skip(reason=f"GPU test skipped: {why}"))
        if "toolchain" in item.keywords and (why := toolchain_unavailable()):
            item.add_marker(pytest.mark.skip(reason=f"toolchain test skipped: {why}"))


@pytest.fixture(autouse=True, scope="session")
def _no_tuned_choices(tmp_path_factory):
    """Tests see no choices a user's `kgen tune` stored (the cache objects would run
    those kernels instead of the ones the tests read their references from): an
    empty tune store of their own; tests/gpu/test_tune.py points at its own."""
    import os

    from kgen.runtime import tuned

    old = os.environ.get("KGEN_TUNE_DIR")
    os.environ["KGEN_TUNE_DIR"] = str(tmp_path_factory.mktemp("tune"))
    tuned._loaded.clear()
    yield
    tuned._loaded.clear()
    if old is None:
        os.environ.pop("KGEN_TUNE_DIR", None)
    else:
        os.environ["KGEN_TUNE_DIR"] = old
