"""The host C++ compiler, the CUDA toolkit's cuda.h and the C ABI over kgen::ops
(tests/cpp/kgen_ops_shim.cpp: building it, loading it, its request line), for the tests
that build the generated C++ API (tests/toolchain/test_tc_cpp_*.py,
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


# ---- the C ABI over kgen::ops (tests/cpp/kgen_ops_shim.cpp) ----------------------------

def build_shim(shim: Path, api_dir: Path, out: Path, flags: tuple[str, ...]) -> str | None:
    """Compile ``shim`` (the checkout's tests/cpp/kgen_ops_shim.cpp) with ``api_dir``'s
    kgen_launch.cpp into the shared library
    ``out`` (extra compiler ``flags``: optimisation, -Werror); None when built, else
    why not (no compiler or no cuda.h: a reason to skip; a failed compile: the command
    and its errors)."""
    import subprocess

    compiler, inc = cxx(), cuda_include()
    if compiler is None or inc is None:
        return "skip: " + ("no C++ compiler (g++, c++ or clang++ on PATH, or $CXX)"
                           if compiler is None else "no cuda.h found (KGEN_CUDA_HOME, "
                           "CUDA_HOME, nvcc's toolkit, /usr/local/cuda/include)")
    cmd = [compiler, "-std=c++17", *flags, "-Wall", "-Wextra", "-shared", "-fPIC",
           f"-I{api_dir}", f"-I{inc}", str(shim), str(api_dir / "kgen_launch.cpp"), "-o",
           str(out), "-ldl"]
    # The library is loaded into a Python process that may hold another libstdc++
    # already (an extension module's): its C++ runtime is linked in and kept private
    # (not exported), so the code compiled against this compiler's headers runs on
    # this compiler's runtime. A compiler without a static runtime builds it plain.
    done = None
    for private in (["-static-libstdc++", "-static-libgcc", "-Wl,--exclude-libs,ALL",
                     "-Wl,-Bsymbolic"], []):
        done = subprocess.run(cmd + private, capture_output=True, text=True)
        if done.returncode == 0:
            return None
    return f"{' '.join(cmd)}\n{done.stderr[-4000:]}"


def load_shim(path: Path, generated_dir: Path | None = None):
    """The built shim through ctypes, its argument types set (and the directory its
    fatbins load from, when launches will run)."""
    import ctypes

    lib = ctypes.CDLL(str(path))
    lib.kgen_ops_call.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p,
                                  ctypes.c_char_p, ctypes.c_int]
    lib.kgen_ops_set_generated_dir.argtypes = [ctypes.c_char_p]
    if generated_dir is not None:
        lib.kgen_ops_set_generated_dir(str(generated_dir).encode())
    return lib


def request(fields: dict) -> bytes:
    """The shim's request line: a device array as (address, shape) or (address, shape,
    element strides), bools and ints as I, floats as F, the rest as S; None left out."""
    parts = []
    for name, v in fields.items():
        if v is None:
            continue
        if isinstance(v, tuple):
            text = f"T:{v[0]}:" + ",".join(str(int(d)) for d in v[1])
            if len(v) > 2:
                text += ":" + ",".join(str(int(s)) for s in v[2])
            parts.append(f"{name}={text}")
        elif isinstance(v, bool | int):
            parts.append(f"{name}=I:{int(v)}")
        elif isinstance(v, float):
            parts.append(f"{name}=F:{v!r}")
        else:
            parts.append(f"{name}=S:{v}")
    return "\t".join(parts).encode()


def call(lib, fields: dict, run: int = 0, stream=None) -> tuple[int, str]:
    """(the Result's code, the reply) of one kgen_ops_call."""
    import ctypes

    buf = ctypes.create_string_buffer(1 << 20)
    code = lib.kgen_ops_call(request(fields), run, stream, buf, len(buf))
    return code, buf.value.decode()
