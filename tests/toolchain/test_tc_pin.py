"""The toolchain is pinned: non-11.8 tools are refused, and the tools never run
with the caller's PATH (where CUDA 13 wrappers sit in /usr/local/bin)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from tc_helpers import TINY_CU

from kgen.errors import ToolchainError
from kgen.toolchain import compile
from kgen.toolchain import locate as toolchain
from kgen.toolchain.cache import Cache
from kgen.toolchain.locate import TOOLS, find_toolchain


@pytest.fixture
def fresh_find(monkeypatch):
    """find_toolchain is memoised: start clean and leave no fake toolchain behind."""
    monkeypatch.delenv("KGEN_CUDA_HOME", raising=False)
    find_toolchain.cache_clear()
    yield
    monkeypatch.undo()
    find_toolchain.cache_clear()


def fake_cuda(root: Path, releases: dict[str, str | None]) -> Path:
    """A CUDA_HOME whose bin/ tools are shell scripts reporting ``release R``.

    None writes a tool that cannot be executed (no interpreter line)."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    for tool, rel in releases.items():
        p = bin_dir / tool
        if rel is None:
            p.write_bytes(b"\x00\x01 not a program\n")
        else:
            p.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {rel}, V{rel}.48'\n")
        p.chmod(0o755)
    return bin_dir


def test_cuda13_tools_are_refused_by_name(tmp_path, monkeypatch, fresh_find):
    bin_dir = fake_cuda(tmp_path / "cuda-13.0", dict.fromkeys(TOOLS, "13.0"))
    monkeypatch.setenv("KGEN_CUDA_HOME", str(bin_dir.parent))
    with pytest.raises(ToolchainError) as info:
        find_toolchain()
    msg = str(info.value)
    assert "KGEN_CUDA_HOME" in msg
    for tool in TOOLS:
        assert f"{bin_dir / tool}: Cuda compilation tools, release 13.0" in msg, msg
    assert "11.8" in msg
    assert info.value.exit_code == 3


def test_one_wrong_tool_is_enough_and_is_the_one_named(tmp_path, monkeypatch, fresh_find):
    bin_dir = fake_cuda(tmp_path / "cuda", {**dict.fromkeys(TOOLS, "11.8"), "ptxas": "13.0"})
    monkeypatch.setenv("KGEN_CUDA_HOME", str(bin_dir.parent))
    with pytest.raises(ToolchainError) as info:
        find_toolchain()
    rejected = str(info.value).split("rejected", 1)[1]
    assert f"{bin_dir / 'ptxas'}: Cuda compilation tools, release 13.0" in rejected
    assert str(bin_dir / "nvcc") not in rejected
    assert str(bin_dir / "cuobjdump") not in rejected


def test_a_release_that_only_starts_with_11_8_is_refused(tmp_path, monkeypatch, fresh_find):
    bin_dir = fake_cuda(tmp_path / "cuda", {**dict.fromkeys(TOOLS, "11.8"), "nvcc": "11.80"})
    monkeypatch.setenv("KGEN_CUDA_HOME", str(bin_dir.parent))
    with pytest.raises(ToolchainError, match="release 11.80"):
        find_toolchain()


def test_a_tool_that_cannot_run_is_refused_not_a_crash(tmp_path, monkeypatch, fresh_find):
    bin_dir = fake_cuda(tmp_path / "cuda", {**dict.fromkeys(TOOLS, "11.8"), "nvcc": None})
    monkeypatch.setenv("KGEN_CUDA_HOME", str(bin_dir.parent))
    with pytest.raises(ToolchainError) as info:
        find_toolchain()
    assert f"{bin_dir / 'nvcc'}: no version" in str(info.value)


def test_a_missing_tool_is_a_toolchain_error(tmp_path, monkeypatch, fresh_find):
    bin_dir = fake_cuda(tmp_path / "cuda", {"nvcc": "11.8", "ptxas": "11.8"})
    monkeypatch.setenv("KGEN_CUDA_HOME", str(bin_dir.parent))
    with pytest.raises(ToolchainError, match="no CUDA 11.8 toolchain"):
        find_toolchain()


def test_fatbinary_is_located_and_pinned_like_the_compilers(tmp_path, monkeypatch, fresh_find):
    bin_dir = fake_cuda(tmp_path / "cuda", dict.fromkeys(TOOLS, "11.8"))
    monkeypatch.setenv("KGEN_CUDA_HOME", str(bin_dir.parent))
    tc = find_toolchain()
    assert tc.fatbinary == str(bin_dir / "fatbinary") and "11.8" in tc.fatbinary_version
    assert [t for t, _ in tc.versions] == ["nvcc", "ptxas", "cuobjdump"]  # what golden records
    find_toolchain.cache_clear()
    (bin_dir / "fatbinary").unlink()
    with pytest.raises(ToolchainError, match="fatbinary"):
        find_toolchain()


@pytest.mark.toolchain
def test_tools_never_see_usr_local_bin(tmp_path, monkeypatch, fresh_find):
    # The caller's PATH leads with the CUDA 13 wrappers.
    monkeypatch.setenv("PATH", "/usr/local/bin:" + os.environ.get("PATH", "/usr/bin:/bin"))
    calls: list[tuple[list[str], dict | None]] = []

    class RecordingPopen(subprocess.Popen):  # every process started (subprocess.run's too)
        def __init__(self, argv, *args, **kwargs):
            calls.append((list(argv), kwargs.get("env")))
            super().__init__(argv, *args, **kwargs)

    monkeypatch.setattr(toolchain.subprocess, "Popen", RecordingPopen)
    tc = find_toolchain()
    assert "/usr/local/bin" not in tc.path_env.split(":")
    assert len(tc.path_env.split(":")) == len(set(tc.path_env.split(":")))
    for path in (tc.nvcc, tc.ptxas, tc.cuobjdump, tc.fatbinary):
        assert Path(path).is_absolute() and not path.startswith("/usr/local/bin/"), path
    assert all("release 11.8" in v for _, v in tc.versions)
    assert "release 11.8" in tc.fatbinary_version

    cache = Cache(tmp_path / "cache")
    text = compile.ptx(TINY_CU, tc, cache, name="tiny")
    cub = compile.cubin(text, tc, cache, name="tiny")
    listing = compile.sass(cub.data, tc, cache, name="tiny")
    assert "code for sm_37" in listing

    argv0 = [argv[0] for argv, _ in calls]
    assert argv0.count(tc.nvcc) == 2 and argv0.count(tc.ptxas) == 2  # --version + stage
    assert tc.cuobjdump in argv0
    for argv, env in calls:
        assert env is not None, f"{argv[0]} ran with the caller's environment"
        assert "/usr/local/bin" not in env["PATH"].split(":"), (argv, env["PATH"])
        assert Path(argv[0]).is_absolute(), argv
