"""The Makefile's CUDA 11.8 set-up on machines it cannot simply apt-get on: apt sources
in either layout get the components the package lives in (and nothing else changes), a
user without root is told the commands to run with sudo, and a system with no 11.8
package is told how to install NVIDIA's toolkit and point KGEN_CUDA_HOME at it. Each
runs the real make target on files of the test's own."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")

DEB822 = """Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main non-free-firmware
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main contrib non-free non-free-firmware
"""
CLASSIC = """# deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm main
deb-src http://deb.debian.org/debian bookworm main contrib
deb [arch=amd64] http://mirror.example/debian bookworm main non-free
"""


def _make(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = None if path is None else dict(os.environ, PATH=path)
    return subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), *args],
                          capture_output=True, text=True, env=env, timeout=60)


def _components(text: str) -> list[set[str]]:
    """Each source line's components (deb822's Components:, a classic line's words after
    its suite); comments skipped."""
    got = []
    for line in text.splitlines():
        if line.startswith("Components:"):
            got.append(set(line.split()[1:]))
        elif line.startswith(("deb ", "deb-src ")):
            words = [w for w in line.split() if not w.startswith("[")]
            got.append(set(words[3:]))
    return got


def test_apt_components_in_both_layouts(tmp_path):
    files = {"debian.sources": DEB822, "sources.list": CLASSIC}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    lists = " ".join(str(tmp_path / n) for n in files)
    r = _make("apt-components", f"APT_LISTS={lists}", "SUDO=")
    assert r.returncode == 0, r.stderr
    for name, text in files.items():
        after = (tmp_path / name).read_text()
        before_lines, after_lines = text.splitlines(), after.splitlines()
        assert len(before_lines) == len(after_lines)
        for was, now in zip(_components(text), _components(after), strict=True):
            assert now == was | {"contrib", "non-free"}, (name, was, now)
        # lines that name no components are kept as they were (comments included)
        for b, a in zip(before_lines, after_lines, strict=True):
            if not b.startswith(("Components:", "deb ", "deb-src ")):
                assert a == b
    # a second run changes nothing, and every component is named once
    snapshot = {n: (tmp_path / n).read_text() for n in files}
    assert _make("apt-components", f"APT_LISTS={lists}", "SUDO=").returncode == 0
    for n in files:
        assert (tmp_path / n).read_text() == snapshot[n]
        for line in snapshot[n].splitlines():
            if line.startswith(("Components:", "deb")):
                words = line.split()
                assert len(words) == len(set(words)), line


def test_no_root_prints_the_sudo_commands(tmp_path):
    (tmp_path / "os-release").write_text('ID=debian\nVERSION_ID="12"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sudo = bin_dir / "sudo"
    sudo.write_text("#!/bin/sh\nexit 1\n")  # a sudo that wants a password
    sudo.chmod(0o755)
    r = _make("cuda-install", f"OS_RELEASE={tmp_path / 'os-release'}", "SUDO=sudo",
              path=f"{bin_dir}:/usr/bin:/bin")
    assert r.returncode == 2
    assert "sudo make apt-components" in r.stderr
    assert "sudo apt-get install -y --no-install-recommends nvidia-cuda-toolkit" in r.stderr
    assert "KGEN_CUDA_HOME" in r.stderr


def test_other_systems_get_nvidia_toolkit_and_kgen_cuda_home(tmp_path):
    (tmp_path / "os-release").write_text(
        'ID=ubuntu\nVERSION_ID="24.04"\nPRETTY_NAME="Ubuntu 24.04 LTS"\n')
    r = _make("cuda-install", f"OS_RELEASE={tmp_path / 'os-release'}")
    assert r.returncode == 2
    assert "Ubuntu 24.04 LTS has no package" in r.stderr
    assert "--toolkit --toolkitpath=$HOME/cuda-11.8" in r.stderr
    assert "export KGEN_CUDA_HOME=$HOME/cuda-11.8" in r.stderr
