"""Builds are deterministic, never half-written, and restore what was changed by hand.

A failed build (spec error, compiler error, broken budget) or a failed
``kgen golden`` must leave generated/ and golden/ exactly as they were.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tc_helpers import OUTPUT_KEYS, covering_specs, finish, kgen_process

from kgen.compiler import atomic
from kgen.compiler.atomic import read_tree, replace_dir
from kgen.compiler.pipeline import checked, parse
from kgen.errors import SpecError

toolchain = pytest.mark.toolchain


def leftovers(parent) -> list[str]:
    """replace_dir's scratch trees (``.<name>.new-*`` / ``.<name>.old-*``) and journals;
    not the build locks (``.<name>.lock``, kept like any lock file)."""
    return sorted(p.name for p in parent.iterdir()
                  if p.name.startswith(".") and not p.name.endswith(".lock"))


# -- determinism ------------------------------------------------------------------


@toolchain
def test_two_fresh_builds_are_byte_identical(tmp_path, ws, monkeypatch):
    # Two processes, each with its own empty cache, from the repo's own specs (so the
    # spec paths written into the sources are the same): the files that reach every
    # skeleton, KV format and I/O dtype (every kernel's SASS is pinned by kgen verify).
    specs = covering_specs()
    procs = [kgen_process("build", "-q", *specs, scratch=tmp_path / f"out{i}",
                          cache_dir=tmp_path / f"cache{i}", generated=tmp_path / f"gen{i}",
                          templates=ws.templates)
             for i in (1, 2)]
    for r in finish(procs):
        assert r.rc == 0, r.text
    a, b = read_tree(tmp_path / "gen1"), read_tree(tmp_path / "gen2")
    assert a and sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], f"{name} differs between two fresh builds"
    # A build in another place (the workspace, a copy of the repo) from the
    # shared, warm cache writes the same bytes as the cold ones.
    monkeypatch.setenv("KGEN_GENERATED", str(tmp_path / "gen3"))
    r = ws.kgen("build", "-q", *(str(ws.specs / Path(p).name) for p in specs))
    assert r.rc == 0, r.text
    assert read_tree(tmp_path / "gen3") == a


# -- failed builds leave the outputs alone ----------------------------------------


def _snapshot(ws):
    """Every output directory kgen may write (generated/, golden/, and any other
    output setting, which the fixtures point at scratch paths)."""
    trees = {key: read_tree(Path(os.environ[f"KGEN_{key.upper()}"])) for key in OUTPUT_KEYS}
    assert trees["generated"] and trees["golden"], "the workspace has no outputs to protect"
    return trees


@toolchain
def test_a_spec_error_writes_nothing(ws):
    before = _snapshot(ws)
    (ws.specs / "util.kspec").write_text(
        (ws.specs / "util.kspec").read_text() + "\nkernel broken : no_such_parent {\n")
    r = ws.kgen("build")
    assert r.rc == 2, r.text
    assert "util.kspec:" in r.err
    assert _snapshot(ws) == before
    assert leftovers(ws.root) == []


@toolchain
def test_a_compiler_error_writes_nothing(ws):
    before = _snapshot(ws)
    ws.edit(ws.templates / "kernels" / "qz_split.cu.j2", "    q[i] = qg[src];\n",
            "    q[i] = qg[src] + kgen_not_cuda;\n")
    r = ws.kgen("build")
    assert r.rc == 4, r.text
    assert "kgen_not_cuda" in r.err and "reproduce with:" in r.err
    assert _snapshot(ws) == before
    assert leftovers(ws.root) == []


@toolchain
def test_a_broken_budget_writes_nothing(ws):
    before = _snapshot(ws)
    ws.edit(ws.specs / "util.kspec", "expect registers <= 16", "expect registers <= 1")
    r = ws.kgen("build")
    assert r.rc == 2, r.text
    assert "fc_attn_qz_split uses" in r.err and "registers <= 1" in r.err
    assert _snapshot(ws) == before
    assert leftovers(ws.root) == []


@toolchain
def test_a_broken_inherited_budget_is_reported_at_the_kernel_that_breaks_it(ws):
    before = _snapshot(ws)
    ws.edit(ws.specs / "prefill.kspec", "    expect spill_loads == 0\n",
            "    expect spill_loads == 0\n    expect spill_loads >= 1\n")
    r = ws.kgen("build", "-q")
    assert r.rc == 2, r.text
    head, shown, _ = r.err.splitlines()
    # Reported at the first kernel, in build order, that inherits the broken budget
    # (whichever spec file sorts first holds it).
    first = next(k for k in checked(parse([ws.specs], ws.root))
                 if any((b.resource, b.op, b.owner) == ("spill_loads", ">=", "flash_base")
                        for b in k.budgets))
    assert head.startswith(f"{first.pos}: error: {first.name} uses 0 spill loads; budget "
                           "`spill_loads >= 1` set at specs/prefill.kspec:"), head
    assert head.endswith("in ancestor 'flash_base' (restate it here, or "
                         "`drop expect spill_loads`)"), head
    line = (ws.root / first.pos.path).read_text(encoding="utf-8").split("\n")[first.pos.line - 1]
    assert shown == SpecError(first.pos, "", line).render().split("\n")[1]
    assert _snapshot(ws) == before


@toolchain
def test_golden_from_a_missing_reference_writes_nothing(ws, tmp_path):
    before = ws.tree("golden")
    r = ws.kgen("golden", "--reference", str(tmp_path / "missing.cu"))
    assert r.rc == 1, r.text
    assert "reference not found" in r.err
    assert ws.tree("golden") == before


# -- replace_dir on its own -------------------------------------------------------


@pytest.fixture
def old_tree(tmp_path):
    target = tmp_path / "out"
    replace_dir(target, {"a.txt": b"old a", "sub/b.txt": b"old b"})
    return target


def test_replace_dir_replaces_exactly(old_tree):
    replace_dir(old_tree, {"c.txt": b"c", "sub/d/e.txt": b"e"})
    assert read_tree(old_tree) == {"c.txt": b"c", "sub/d/e.txt": b"e"}
    assert leftovers(old_tree.parent) == []


def test_replace_dir_keeps_named_entries(old_tree):
    replace_dir(old_tree, {"c.txt": b"c"}, keep=("sub",))
    assert read_tree(old_tree) == {"c.txt": b"c", "sub/b.txt": b"old b"}


def test_an_error_while_writing_leaves_the_old_tree(old_tree):
    before = read_tree(old_tree)
    with pytest.raises(TypeError):
        replace_dir(old_tree, {"a.txt": b"new a", "b.txt": None})  # not bytes
    assert read_tree(old_tree) == before
    assert leftovers(old_tree.parent) == []


def test_an_error_at_the_swap_restores_the_old_tree(old_tree, monkeypatch):
    before = read_tree(old_tree)
    real_rename = os.rename

    def failing_rename(src, dst):
        if os.fspath(dst) == os.fspath(old_tree) and ".new-" in os.fspath(src):
            raise OSError("disk full (simulated)")
        return real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", failing_rename)
    with pytest.raises(OSError, match="simulated"):
        replace_dir(old_tree, {"a.txt": b"new a"})
    monkeypatch.undo()
    assert read_tree(old_tree) == before
    assert leftovers(old_tree.parent) == []


def test_an_interrupt_while_writing_leaves_the_old_tree(old_tree, monkeypatch):
    before = read_tree(old_tree)
    real = atomic.Path.write_bytes
    calls = []

    def interrupted(self, data):
        calls.append(self)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(atomic.Path, "write_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        replace_dir(old_tree, {"x.txt": b"x", "y.txt": b"y", "z.txt": b"z"})
    monkeypatch.undo()
    assert read_tree(old_tree) == before
    assert leftovers(old_tree.parent) == []


@pytest.mark.parametrize("bad", ["../escape.txt", "/abs.txt", "sub/../../escape.txt", ""])
def test_replace_dir_refuses_paths_outside_the_target(old_tree, bad):
    before = read_tree(old_tree)
    with pytest.raises(ValueError):
        replace_dir(old_tree, {"ok.txt": b"ok", bad: b"x"})
    assert read_tree(old_tree) == before
    assert not (old_tree.parent / "escape.txt").exists()
    assert leftovers(old_tree.parent) == []


# -- a build restores its outputs ------------------------------------------------------


@toolchain
def test_a_build_restores_a_hand_edited_tree(ws):
    assert ws.kgen("build").rc == 0
    fresh = ws.tree("generated")
    src = ws.generated / "src" / "fc_attn_qz_split.cu"
    src.write_text(src.read_text() + "// hand edit\n")
    (ws.generated / "stray.txt").write_text("not generated\n")
    (ws.generated / "kernels" / "fc_attn_kv_append.fatbin").unlink()
    assert ws.tree("generated") != fresh
    r = ws.kgen("build")
    assert r.rc == 0 and "up to date" not in r.out, r.text  # outputs changed: no no-op
    assert ws.tree("generated") == fresh
