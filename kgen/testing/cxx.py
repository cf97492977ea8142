"""The host C++ compiler and the CUDA toolkit's cuda.h, for the tests that build the
generated C++ API (tests/toolchain/test_tc_cpp_api.py, test_tc_cpp_ops.py,
tests/gpu/test_cpp_launch.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cxx() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or \
        shutil.which("clang++")


def cuda_include() -> Path | None:
    """The directory of the toolkit's cuda.h (KGEN_CUDA_HOME, CUDA_HOME, the located
    toolchain, nvcc on PATH, the system include directories)."""
    roots = []
    for var in ("KGEN_CUDA_HOME", "CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            roots.append(Path(os.environ[var]) / "include")
    nvccs = []
    try:
        from kgen.toolchain.locate import find_toolchain

        nvccs.append(Path(find_toolchain().nvcc))
    except Exception:
        pass
    if shutil.which("nvcc"):
        nvccs.append(Path(shutil.which("nvcc")))
    for nvcc in nvccs:
        nvcc = nvcc.resolve()
        roots += [nvcc.parents[1] / "include", nvcc.parents[1] / "targets" / "x86_64-linux"
                  / "include"]
    roots += [Path("/usr/include"), Path("/usr/local/cuda/include")]
    return next((r for r in roots if (r / "cuda.h").is_file()), None)
