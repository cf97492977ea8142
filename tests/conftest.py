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
    from kgen.toolchain import find_toolchain

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
