"""The toolchain stages: CUDA source -> PTX -> cubin -> SASS, and PTX + cubin ->
fatbin, cached.

Each stage is one function named for what it produces. Everything that can
change a stage's output (its input bytes, the exact flags, every tool's version
line and kgen's own version) goes into a frozen ``CompileJob`` whose hash is the
cache key, so a cached artifact is reused only when it would be rebuilt
byte-identical.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kgen import __version__
from kgen.errors import KgenError, ToolError
from kgen.toolchain import fatbin as fatbin_format
from kgen.toolchain.cache import Cache, sha256
from kgen.toolchain.locate import PGID_MARK, TARGET_ARCH, Toolchain, end_group

# nvcc's front end (cicc) is what the golden is made with: NVRTC gives other
# PTX for the same source, so golden and generated code share these flags.
NVCC_PTX_FLAGS = ("-ptx", f"-arch={TARGET_ARCH}", "-Wno-deprecated-gpu-targets")
PTXAS_FLAGS = (f"-arch={TARGET_ARCH}", "-v")
CUOBJDUMP_FLAGS = ("-sass",)
# One load artifact for every GPU: the sm_37 SASS (the cubin verify checks, stored
# uncompressed, byte for byte) and the compute_37 PTX for the driver to JIT on newer
# GPUs (compressed, fatbinary's default). The image files follow these flags.
_SM = TARGET_ARCH.removeprefix("sm_")
FATBINARY_FLAGS = ("-64", "--compress=true", f"--image3=kind=elf,sm={_SM}",
                   f"--image3=kind=ptx,sm={_SM}")


@dataclass(frozen=True)
class CompileJob:
    """One stage's complete input; ``key`` names its cached output."""

    stage: str
    input_sha256: str
    flags: tuple[str, ...]
    tools: tuple[tuple[str, str], ...]
    kgen_version: str = __version__

    @property
    def key(self) -> str:
        return sha256(json.dumps(self.__dict__, sort_keys=True).encode())


def _job(stage: str, data: bytes, flags: tuple[str, ...], tc: Toolchain) -> CompileJob:
    return CompileJob(stage, sha256(data), flags, tc.versions)


def ptx_job(source: str, tc: Toolchain) -> CompileJob:
    """The ptx stage's key also names the host compiler nvcc preprocesses with."""
    return CompileJob("ptx", sha256(source.encode()), NVCC_PTX_FLAGS,
                      (*tc.versions, ("host_compiler", tc.host_compiler)))


@contextlib.contextmanager
def _workdir(stage: str) -> Iterator[Path]:
    """A private directory for one tool run, removed afterwards -- except when
    the tool fails: then its input stays where the ``reproduce with:`` command
    in the ToolError expects it."""
    d = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{stage}-{os.getpid()}-"))
    try:
        yield d
    except ToolError:
        raise
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    shutil.rmtree(d, ignore_errors=True)


WORKDIR_PREFIX = "kgen-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True


def clean_workdirs() -> list[Path]:
    """Remove the tool work directories (``kgen-<stage>-<pid>-*`` in the temporary
    directory) of processes that are gone: killed builds, and failed tools whose
    ``reproduce with:`` directory the next build no longer needs."""
    removed = []
    for d in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*-*-*"):
        parts = d.name.split("-")
        if len(parts) < 4 or not parts[2].isdigit() or not d.is_dir():
            continue
        if int(parts[2]) != os.getpid() and not _alive(int(parts[2])):
            # The tools a killed build left running (their group named in the
            # directory) end first: nothing still writes there when it goes.
            for mark in d.glob(f"{PGID_MARK}*"):
                pgid = mark.name.removeprefix(PGID_MARK)
                if pgid.isdigit():
                    end_group(int(pgid))
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def stored_ptx(source: str, tc: Toolchain, cache: Cache) -> str | None:
    """The PTX of ``source`` if the store has it."""
    hit = cache.get(ptx_job(source, tc).key, ("out.ptx",))
    return None if hit is None else hit["out.ptx"].decode()


def store_ptx(source: str, text: str, tc: Toolchain, cache: Cache) -> None:
    """Store ``text`` as the PTX of ``source`` (a unit's part of a batch's PTX, which is
    what the unit compiles to alone)."""
    cache.put(ptx_job(source, tc).key, {"out.ptx": text.encode()})


def ptx(source: str, tc: Toolchain, cache: Cache, name: str = "module") -> str:
    """CUDA C++ -> PTX with nvcc's front end."""
    data = source.encode()
    job = ptx_job(source, tc)
    hit = cache.get(job.key, ("out.ptx",))
    if hit is not None:
        return hit["out.ptx"].decode()
    with _workdir("ptx") as tmp:
        src = tmp / f"{name}.cu"
        out = tmp / f"{name}.ptx"
        src.write_bytes(data)
        tc.run([tc.nvcc, *NVCC_PTX_FLAGS, str(src), "-o", str(out)], cwd=tmp)
        text = out.read_bytes()
    cache.put(job.key, {"out.ptx": text})
    return text.decode()


@dataclass(frozen=True)
class Cubin:
    data: bytes
    ptxas_log: str


def cubin(ptx_text: str, tc: Toolchain, cache: Cache, name: str = "module",
          arch: str = TARGET_ARCH) -> Cubin:
    """PTX -> sm_37 cubin with ptxas; keeps ptxas's resource report (-v). Another
    ``arch`` (``kgen show --sass --arch``) compiles the same PTX as a driver's JIT would
    for that GPU, with this toolchain's ptxas."""
    data = ptx_text.encode()
    flags = PTXAS_FLAGS if arch == TARGET_ARCH else (f"-arch={arch}", *PTXAS_FLAGS[1:])
    job = _job("cubin", data, flags, tc)
    hit = cache.get(job.key, ("out.cubin", "ptxas.log"))
    if hit is not None:
        return Cubin(hit["out.cubin"], hit["ptxas.log"].decode())
    with _workdir("cubin") as tmp:
        src = tmp / f"{name}.ptx"
        out = tmp / f"{name}.cubin"
        src.write_bytes(data)
        proc = tc.run([tc.ptxas, *flags, str(src), "-o", str(out)], cwd=tmp)
        blob = out.read_bytes()
    log = (proc.stdout + proc.stderr).replace(str(src), f"{name}.ptx")
    cache.put(job.key, {"out.cubin": blob, "ptxas.log": log.encode()})
    return Cubin(blob, log)


def sass(cubin_data: bytes, tc: Toolchain, cache: Cache, name: str = "module") -> str:
    """cubin -> SASS listing (every kernel, encodings included) with cuobjdump."""
    job = _job("sass", cubin_data, CUOBJDUMP_FLAGS, tc)
    hit = cache.get(job.key, ("out.sass",))
    if hit is not None:
        return hit["out.sass"].decode()
    with _workdir("sass") as tmp:
        src = tmp / f"{name}.cubin"
        src.write_bytes(cubin_data)
        proc = tc.run([tc.cuobjdump, *CUOBJDUMP_FLAGS, str(src)], cwd=tmp)
    text = proc.stdout
    cache.put(job.key, {"out.sass": text.encode()})
    return text


def fatbin_job(ptx_text: str, cubin_data: bytes, ident: str, tc: Toolchain) -> CompileJob:
    """Keyed by both images, the flags (the identifier included) and fatbinary's
    version besides the compilers'."""
    inputs = sha256((sha256(ptx_text.encode()) + sha256(cubin_data)).encode())
    return CompileJob("fatbin", inputs, (*FATBINARY_FLAGS, f"--ident={ident}"),
                      (*tc.versions, ("fatbinary", tc.fatbinary_version)))


def fatbin(ptx_text: str, cubin_data: bytes, tc: Toolchain, cache: Cache,
           name: str = "module", ident: str = "") -> bytes:
    """PTX + its cubin -> one fatbin with fatbinary; ``ident`` is the identifier
    written into each image (``cuobjdump`` shows it). The result is checked: its
    SASS image is exactly ``cubin_data`` and its PTX image has the PTX's ISA."""
    job = fatbin_job(ptx_text, cubin_data, ident, tc)
    hit = cache.get(job.key, ("out.fatbin",))
    if hit is not None:
        return hit["out.fatbin"]
    with _workdir("fatbin") as tmp:
        cub, ptx_file, out = tmp / f"{name}.cubin", tmp / f"{name}.ptx", tmp / f"{name}.fatbin"
        cub.write_bytes(cubin_data)
        ptx_file.write_bytes(ptx_text.encode())
        elf_image, ptx_image = FATBINARY_FLAGS[2:]
        tc.run([tc.fatbinary, f"--create={out}", *FATBINARY_FLAGS[:2],
                f"{elf_image},file={cub}", f"{ptx_image},file={ptx_file}",
                *([f"--ident={ident}"] if ident else [])], cwd=tmp)
        blob = out.read_bytes()
    _check_fatbin(blob, ptx_text, cubin_data, name)
    cache.put(job.key, {"out.fatbin": blob})
    return blob


def _check_fatbin(blob: bytes, ptx_text: str, cubin_data: bytes, name: str) -> None:
    images = fatbin_format.entries(blob)
    sass = [e for e in images if e.kind == "sass"]
    ptx_images = [e for e in images if e.kind == "ptx"]
    arch = int(_SM)
    if not (len(sass) == 1 and sass[0].arch == arch and not sass[0].compressed
            and sass[0].payload == cubin_data):
        raise KgenError(f"{name}.fatbin: its SASS image is not the cubin it was made from")
    if not (len(ptx_images) == 1 and ptx_images[0].arch == arch
            and ptx_images[0].version == fatbin_format.ptx_isa(ptx_text)):
        raise KgenError(f"{name}.fatbin: its PTX image is not the PTX it was made from")
