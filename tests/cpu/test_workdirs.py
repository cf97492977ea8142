"""A killed build's tools: the next build ends the process groups its dead owner left
running (named in their work directory) before it removes the directory, so nothing
still writes there when it goes, and no orphaned compiler keeps a core busy."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

from kgen.toolchain.compile import WORKDIR_PREFIX, clean_workdirs
from kgen.toolchain.locate import PGID_MARK


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_tools_of_a_dead_build_end_before_their_directory_goes(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    d = tmp_path / f"{WORKDIR_PREFIX}ptx-{_dead_pid()}-x1"
    d.mkdir()
    # A tool that started a tool of its own (nvcc -> cicc), in a group of its own.
    tool = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], process_group=0)
    (d / f"{PGID_MARK}{tool.pid}").touch()
    mine = tmp_path / f"{WORKDIR_PREFIX}ptx-{os.getpid()}-x2"  # this process's: kept
    mine.mkdir()
    assert clean_workdirs() == [d]
    assert not d.exists() and mine.exists()
    assert tool.wait(timeout=10) == -9
    deadline = time.monotonic() + 10
    while _group_alive(tool.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # the grandchild, reparented, is reaped by init
    assert not _group_alive(tool.pid)
