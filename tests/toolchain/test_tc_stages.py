"""Each toolchain stage on its own, on a tiny CUDA source: ptx, cubin, sass, and
what a failing tool reports (a message that reproduces the failure)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from tc_helpers import BROKEN_CU, TINY_CU

from kgen.errors import ToolError
from kgen.toolchain import compile, ptx_entries, resources, sass_listing
from kgen.toolchain.cache import Cache

pytestmark = pytest.mark.toolchain

ENCODING = re.compile(r"0x[0-9a-f]{16}")


@pytest.fixture
def cache(tmp_path) -> Cache:
    return Cache(tmp_path / "cache")


def test_ptx_stage_targets_sm37_and_has_the_entries(tc, cache, clean_env):
    text = compile.ptx(TINY_CU, tc, cache, name="tiny")
    assert re.search(r"^\.target sm_37\b", text, re.M), text[:400]
    assert ".visible .entry kgen_tiny(" in text
    assert set(ptx_entries.entries(text)) == {"kgen_tiny", "kgen_tiny_smem"}
    # The work directory is gone once the tool succeeded.
    assert list(clean_env.iterdir()) == []


def test_cubin_stage_gives_elf_and_a_ptxas_report(tc, cache, clean_env):
    cub = compile.cubin(compile.ptx(TINY_CU, tc, cache, name="tiny"), tc, cache, name="tiny")
    assert cub.data[:4] == b"\x7fELF"
    assert "Compiling entry function 'kgen_tiny' for 'sm_37'" in cub.ptxas_log
    # The temporary path ptxas saw is not in the (cached) log.
    assert str(clean_env) not in cub.ptxas_log
    res = resources.parse(cub.ptxas_log)
    assert set(res) == {"kgen_tiny", "kgen_tiny_smem"}
    assert res["kgen_tiny"].registers > 0
    assert res["kgen_tiny"].static_smem == 0
    assert res["kgen_tiny_smem"].static_smem == 64 * 4
    assert list(clean_env.iterdir()) == []


def test_sass_stage_lists_every_function_with_64bit_encodings(tc, cache, clean_env):
    cub = compile.cubin(compile.ptx(TINY_CU, tc, cache, name="tiny"), tc, cache, name="tiny")
    listing = compile.sass(cub.data, tc, cache, name="tiny")
    assert "Function : kgen_tiny" in listing
    parsed = sass_listing.parse(listing)
    assert set(parsed) == {"kgen_tiny", "kgen_tiny_smem"}
    stream = parsed["kgen_tiny"]
    assert len(stream) > 8
    assert all(ENCODING.fullmatch(i.encoding) for i in stream), stream
    instrs = [i for i in stream if i.addr is not None]
    controls = [i for i in stream if i.addr is None]
    # Kepler: one scheduling-control word ahead of every seven instructions.
    assert stream[0].addr is None
    assert len(controls) == -(-len(instrs) // 7)
    assert any(i.text.startswith("EXIT") for i in instrs)
    assert [i.addr for i in instrs] == sorted(i.addr for i in instrs)
    assert list(clean_env.iterdir()) == []


def _reproduce_line(message: str) -> str:
    lines = message.splitlines()
    i = lines.index("reproduce with:")
    return lines[i + 1].strip()


def _shell_env() -> dict[str, str]:
    # The caller's PATH puts the CUDA 13 wrappers first: the command's own
    # PATH= must be what makes it use the pinned toolchain.
    return {"PATH": "/usr/local/bin:" + os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/tmp"), "LC_ALL": "C"}


def test_a_compiler_error_reports_the_message_and_a_working_reproduce_command(
        tc, cache, clean_env):
    with pytest.raises(ToolError) as info:
        compile.ptx(BROKEN_CU, tc, cache, name="broken")
    msg = str(info.value)
    assert "kgen_undefined_name" in msg and "is undefined" in msg, msg
    cmd = _reproduce_line(msg)
    argv = shlex.split(cmd)
    assert argv[0] == f"PATH={tc.path_env}"
    assert "/usr/local/bin" not in argv[0].split("=", 1)[1].split(":")
    assert argv[1] == tc.nvcc
    assert "-arch=sm_37" in argv
    sources = [a for a in argv if a.endswith(".cu")]
    assert len(sources) == 1
    # The input stays where the command expects it, byte for byte.
    assert Path(sources[0]).read_text() == BROKEN_CU
    assert Path(sources[0]).is_relative_to(clean_env)

    proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, env=_shell_env(),
                          cwd="/", check=False)
    assert proc.returncode != 0
    assert "kgen_undefined_name" in proc.stdout + proc.stderr
    # Nothing was cached for the failing source.
    assert not any((cache.root).rglob("manifest.json"))


def test_a_ptxas_error_reproduces_too(tc, cache, clean_env):
    bad_ptx = compile.ptx(TINY_CU, tc, cache, name="tiny").replace(
        "ret;", "kgen_not_an_instruction;", 1)
    with pytest.raises(ToolError) as info:
        compile.cubin(bad_ptx, tc, cache, name="tiny")
    msg = str(info.value)
    assert "kgen_not_an_instruction" in msg, msg
    cmd = _reproduce_line(msg)
    argv = shlex.split(cmd)
    assert argv[1] == tc.ptxas
    proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, env=_shell_env(),
                          cwd="/", check=False)
    assert proc.returncode != 0
    assert "kgen_not_an_instruction" in proc.stdout + proc.stderr
