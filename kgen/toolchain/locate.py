"""Locate the pinned CUDA 11.8 toolchain and run its tools with an explicit PATH.

CUDA 11.8 is the last toolkit that targets sm_37. A machine may also carry a
newer CUDA whose wrappers sit early on PATH; nvcc 11.8 would then pick that
ptxas and reject sm_37. So every tool runs by absolute path with a PATH built
from the toolchain's own directories, never the caller's.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kgen.errors import ToolchainError, ToolError
from kgen.ir.target import TARGET

PINNED_RELEASE = "11.8"
TARGET_ARCH = TARGET.arch  # the target object owns it

# Where CUDA 11.8 is found when KGEN_CUDA_HOME is not set: each entry is the
# list of directories that together hold nvcc, ptxas, cuobjdump and fatbinary.
KNOWN_LAYOUTS: tuple[tuple[str, ...], ...] = (
    ("/usr/local/cuda-11.8/bin",),
    ("/usr/lib/nvidia-cuda-toolkit/bin", "/usr/bin"),  # Debian's nvidia-cuda-toolkit
    ("/opt/cuda-11.8/bin",),
)
TOOLS = ("nvcc", "ptxas", "cuobjdump", "fatbinary")
# The tools whose versions key every stage and golden/ records (what golden was made
# with). fatbinary only packs the fatbin stage's output, so its version keys that
# stage alone: golden/ and the ptx/cubin/sass cache entries stay valid without it.
COMPILERS = ("nvcc", "ptxas", "cuobjdump")
VERSION_TIMEOUT_S = 10  # `--version` answers at once; a tool that does not is reported
INSTALL_HINT = (
    "install it with `make setup` (Debian: nvidia-cuda-toolkit from non-free) "
    "or point KGEN_CUDA_HOME at a CUDA 11.8 install"
)


@dataclass(frozen=True)
class Toolchain:
    """Absolute tool paths plus the version line each tool reports (``versions``:
    the COMPILERS; ``fatbinary_version``: fatbinary's)."""

    nvcc: str
    ptxas: str
    cuobjdump: str
    versions: tuple[tuple[str, str], ...]
    path_env: str
    host_compiler: str = ""  # nvcc preprocesses through it, so it keys the ptx stage
    fatbinary: str = ""
    fatbinary_version: str = ""

    def env(self) -> dict[str, str]:
        env = {"PATH": self.path_env, "LC_ALL": "C", "LANG": "C"}
        if "HOME" in os.environ:
            env["HOME"] = os.environ["HOME"]
        return env

    def run(self, argv: list[str], cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """Run one tool; on failure raise ToolError with the reproducing command.

        The tool runs in a process group of its own (nvcc and the cicc and ptxas it
        starts), named in its work directory ``cwd`` by a file ``.pgid-<pgid>``: should
        this process die without ending it (SIGKILL), the next build ends the group
        before it removes the directory (kgen.toolchain.compile.clean_workdirs); while
        this process lives, an interrupt or exit ends the group with it."""
        child = subprocess.Popen(argv, cwd=cwd, env=self.env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, process_group=0)
        _GROUPS.add(child.pid)
        mark = Path(cwd, f"{PGID_MARK}{child.pid}") if cwd is not None else None
        try:
            if mark is not None:
                mark.touch()
            out, err = child.communicate()
        except BaseException:
            end_group(child.pid)
            child.wait()
            raise
        finally:
            _GROUPS.discard(child.pid)
            if mark is not None:
                mark.unlink(missing_ok=True)
        proc = subprocess.CompletedProcess(argv, child.returncode, out, err)
        if proc.returncode != 0:
            raise ToolError(argv, self.path_env, proc.returncode, proc.stdout + proc.stderr)
        return proc


# A running tool's process group is named in its work directory by this file prefix.
PGID_MARK = ".pgid-"
_GROUPS: set[int] = set()  # the process groups of the tools running now


def end_group(pgid: int) -> bool:
    """SIGKILL to the process group ``pgid`` (a tool and what it started); whether one
    was there."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


@atexit.register
def _end_running_tools() -> None:
    """An exit (an interrupt's included) ends the tools this process started."""
    for pgid in list(_GROUPS):
        end_group(pgid)


def _version_line(tool: str) -> str:
    """The tool's ``release`` line, or "" when it cannot say (it is then rejected);
    ToolchainError naming the tool when it does not answer in VERSION_TIMEOUT_S."""
    try:
        proc = subprocess.run(
            [tool, "--version"], capture_output=True, text=True, check=False,
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"}, timeout=VERSION_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise ToolchainError(f"`{tool} --version` did not answer within {VERSION_TIMEOUT_S} s "
                             "(a hung or wrapped tool?); " + INSTALL_HINT) from None
    except (OSError, subprocess.SubprocessError):
        # Not runnable here (wrong architecture, no interpreter).
        return ""
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "release" in ln]
    return lines[-1].strip() if lines else ""


def _host_compiler(path_env: str) -> str:
    """The first line of `g++ --version` as nvcc will find it on ``path_env``."""
    gxx = shutil.which("g++", path=path_env)
    if gxx is None:
        return ""
    try:
        proc = subprocess.run([gxx, "--version"], capture_output=True, text=True, check=False,
                              env={"PATH": path_env, "LC_ALL": "C"}, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (proc.stdout.splitlines() or [""])[0].strip()


def _layouts() -> list[tuple[str, ...]]:
    home = os.environ.get("KGEN_CUDA_HOME")
    if home:
        bin_dir = str(Path(home) / "bin")
        # A known layout that starts there (Debian's toolkit keeps ptxas and cuobjdump
        # in /usr/bin) is searched whole.
        known = [lay for lay in KNOWN_LAYOUTS
                 if os.path.realpath(lay[0]) == os.path.realpath(bin_dir)]
        return known or [(bin_dir,)]
    return list(KNOWN_LAYOUTS)


def _find(layout: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """(tool -> path for the tools found in ``layout``, the names of those missing)."""
    found, missing = {}, []
    for tool in TOOLS:
        for d in layout:
            p = Path(d) / tool
            if p.is_file() and os.access(p, os.X_OK):
                found[tool] = str(p)
                break
        else:
            missing.append(tool)
    return found, missing


def _resolve(layout: tuple[str, ...]) -> dict[str, str] | None:
    found, missing = _find(layout)
    return None if missing else found


@cache
def find_toolchain() -> Toolchain:
    """The first complete CUDA 11.8 toolchain; ToolchainError if there is none."""
    rejected, incomplete = [], []
    for layout in _layouts():
        tools, missing = _find(layout)
        if missing:
            if tools:  # a partial toolkit is worth naming
                incomplete.append(f"{' + '.join(layout)} lacks {', '.join(missing)}")
            continue
        versions = tuple((t, _version_line(p)) for t, p in tools.items())
        bad = [f"{tools[t]}: {v or 'no version'}" for t, v in versions
               if not re.search(rf"release {re.escape(PINNED_RELEASE)}\b", v)]
        if bad:
            rejected.extend(bad)
            continue
        dirs = list(dict.fromkeys(str(Path(p).parent) for p in tools.values()))
        # nvcc needs a host compiler for preprocessing; the toolkit's own
        # directories come first so its pinned gcc wrapper wins.
        path_env = ":".join(dict.fromkeys([*dirs, "/usr/bin", "/bin"]))
        line = dict(versions)
        return Toolchain(versions=tuple((t, line[t]) for t in COMPILERS), path_env=path_env,
                         host_compiler=_host_compiler(path_env),
                         fatbinary_version=line["fatbinary"], **tools)
    home = os.environ.get("KGEN_CUDA_HOME")
    searched = "; ".join(" + ".join(lay) for lay in _layouts())
    where = (f"KGEN_CUDA_HOME={home} (searched {searched})" if home
             else f"the known locations ({searched})")
    detail = ("; rejected " + ", ".join(rejected)) if rejected else ""
    detail += ("; " + "; ".join(incomplete)) if incomplete else ""
    raise ToolchainError(
        f"no CUDA {PINNED_RELEASE} toolchain ({', '.join(TOOLS)}) in {where}{detail}; "
        + INSTALL_HINT
    )
