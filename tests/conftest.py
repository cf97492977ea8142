"""Test tiers and the one GPU marker.

Tiers: pure Python (no marker), ``toolchain`` (needs CUDA 11.8: compile, SASS,
no GPU) and ``gpu`` (needs a CUDA device and CuPy). A tier whose requirement is
missing is skipped with the reason; the markers are declared in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _alias_generated_package() -> None:
    """Make generated/ importable as kgen_kernels where kgen is not installed
    (e.g. a GPU machine that only has the checkout on PYTHONPATH)."""
    if importlib.util.find_spec("kgen_kernels") is not None:
        return
    init = ROOT / "generated" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "kgen_kernels", init, submodule_search_locations=[str(init.parent)])
    if spec is None or not init.is_file():
        return
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kgen_kernels"] = mod
    spec.loader.exec_module(mod)


_alias_generated_package()


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
