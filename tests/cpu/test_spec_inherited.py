"""Errors on inherited choices point at the user's kernel, with notes at the parent's lines.

A user's spec file beside specs/ declares a kernel that inherits one of the spec tree's
kernels and changes one choice, making a combination invalid with a choice it inherits
(the parent's ``ring_floor = batch``, ``micro_rows``, ``qk_split``, a relation): the error
is at the user's line that made it invalid (or at the user's kernel, where none of its
own lines takes part), names the kernel, and a ``note:`` points at each inherited choice
that takes part, in the parent's file. Exit 2, no traceback.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from enum import Enum
from pathlib import Path

import pytest

from kgen.cli import main
from kgen.compiler import pipeline
from kgen.compiler.spec.ast import ExpectRelation
from kgen.compiler.spec.expand import expand
from kgen.compiler.spec.parser import parse_spec
from kgen.errors import SourcePos, SpecError
from kgen.ir.axes import KEYS
from kgen.ops import get

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"
DIAG = re.compile(r"^(?P<path>[^\n]+?):(?P<line>\d+):(?P<col>\d+): (?P<kind>error|note): "
                  r"(?P<msg>.+)$")
CHILD = "zz_child"


@functools.cache
def real() -> dict:
    return {k.name: k for k in pipeline.checked(pipeline.parse([SPECS], ROOT))}


@pytest.fixture(scope="module")
def specs_copy(tmp_path_factory) -> Path:
    """The spec tree in a directory of its own, for user files beside it."""
    d = tmp_path_factory.mktemp("user") / "specs"
    shutil.copytree(SPECS, d)
    return d


def in_copy(pos: SourcePos, copy: Path) -> tuple[str, int, int]:
    """Where a position of specs/ is in the copy, as ``kgen check`` of the copy says it."""
    return str(copy / Path(pos.path).name), pos.line, pos.col


def diagnostics(err: str) -> list[tuple[str, str, int, int, str]]:
    """(kind, path, line, col, message) of each heading of stderr."""
    return [(m["kind"], m["path"], int(m["line"]), int(m["col"]), m["msg"])
            for m in map(DIAG.match, err.split("\n")) if m]


def check_user(capsys, spec_dir: Path, text: str, *more: str) -> tuple[Path, list]:
    """``kgen check`` of a user file ``text`` in ``spec_dir`` (with ``more`` inputs): it
    exits 2 with no traceback and nothing on stdout; its diagnostics."""
    user = spec_dir / "zz_user.kspec"
    user.write_text(text, encoding="utf-8")
    try:
        rc = main(["check", str(user), *more])
    finally:
        user.unlink()
    out, err = capsys.readouterr()
    assert (rc, out) == (2, ""), err
    assert "Traceback" not in err
    said = diagnostics(err)
    assert said and said[0][0] == "error" and all(s[0] == "note" for s in said[1:]), err
    return user, said


def at(text: str, needle: str) -> tuple[int, int]:
    """The line and column of ``needle`` in ``text`` (1-based)."""
    before = text[:text.index(needle)]
    return before.count("\n") + 1, len(before) - before.rfind("\n")


def child(parent: str, *lines: str, name: str = CHILD) -> str:
    body = "".join(f"    {ln}\n" for ln in ("module = zz_user", 'doc = "a user kernel"', *lines))
    return f"kernel {name} : {parent} {{\n{body}}}\n"


# (parent in specs/, the child's choice, the contract, the inherited key it meets)
CASES = [
    ("fc_attn_flash_prefill_q4", "kv = f32", "check_ring_floor", "ring_floor"),
    ("fc_attn_flash_prefill_q4", "kv = f16", "check_ring_floor", "ring_floor"),
    ("qt_f32_causal", "tile_rows = 3", "check_schedule", "micro_rows"),
    ("qs_f32_causal_d256", "max_head_dim = 192", "check_schedule", "qk_split"),
]


@pytest.mark.parametrize("parent, choice, contract, key", CASES,
                         ids=[f"{p}-{c.replace(' = ', '=')}" for p, c, _, _ in CASES])
def test_a_childs_choice_against_an_inherited_one(specs_copy, capsys, parent, choice,
                                                  contract, key):
    text = child(parent, choice)
    user, said = check_user(capsys, specs_copy, text)
    (kind, path, line, col, msg), *notes = said
    assert (path, line, col) == (str(user), *at(text, choice))
    assert f"'{CHILD}'" in msg and msg.endswith(f"[{contract}]")
    inherited = real()[parent].settings(key)[-1]
    value = getattr(inherited.value, "value", inherited.value)
    note = ("note", *in_copy(inherited.pos, specs_copy),
            f"'{CHILD}' inherits {key} = {value} from '{inherited.owner}'")
    assert note in notes
    assert all(Path(n[1]).parent == specs_copy for n in notes)


def test_a_childs_choice_against_an_inherited_relation(specs_copy, capsys):
    parent = "qs_f32_causal_opts"
    (relation,) = real()[parent].relations
    text = child(parent, "kv = f16")
    user, said = check_user(capsys, specs_copy, text)
    (kind, path, line, col, msg), *notes = said
    assert (path, line, col) == (str(user), *at(text, "kv = f16"))
    assert f"'{CHILD}' and '{relation.other}' take different inputs" in msg
    assert notes == [("note", *in_copy(relation.pos, specs_copy),
                      f"'{CHILD}' inherits 'expect bit_exact with {relation.other}' from "
                      f"'{relation.owner}'")]


def test_an_inherited_module_of_another_file_is_the_kernels_error(specs_copy, capsys):
    """No line of the child takes part: the error is at the child's name."""
    parent = "fc_attn_flash_prefill"
    text = f'kernel {CHILD} : {parent} {{\n    doc = "a copy"\n}}\n'
    user, said = check_user(capsys, specs_copy, text)
    (kind, path, line, col, msg), *notes = said
    assert (path, line, col) == (str(user), *at(text, CHILD))
    assert "a module's kernels are defined in one spec file" in msg and f"'{CHILD}'" in msg
    module = real()[parent].settings("module")[-1]
    assert notes == [("note", *in_copy(module.pos, specs_copy),
                      f"'{CHILD}' inherits module = {module.value} from '{module.owner}'")]


def test_a_users_own_parent_makes_the_combination(specs_copy, capsys):
    """The choice that breaks the inherited one is the user's abstract parent's: the error
    is at that line, naming the kernel checked."""
    text = ("abstract kernel zz_base : fc_attn_flash_prefill_q4 {\n    kv = f16\n}\n\n"
            + child("zz_base"))
    user, said = check_user(capsys, specs_copy, text)
    (kind, path, line, col, msg), *notes = said
    assert (path, line, col) == (str(user), *at(text, "kv = f16"))
    assert f"(in kernel '{CHILD}')" in msg
    ring = real()["fc_attn_flash_prefill_q4"].settings("ring_floor")[-1]
    assert ("note", *in_copy(ring.pos, specs_copy),
            f"'{CHILD}' inherits ring_floor = batch from 'fc_attn_flash_prefill_q4'") in notes


def test_a_family_binding_is_the_childs_choice(specs_copy, capsys):
    text = ("kernel zz_child_{kv} : fc_attn_flash_prefill_q4 for kv in [f32, f16] {\n"
            "    module = zz_user\n}\n")
    user, said = check_user(capsys, specs_copy, text)
    (kind, path, line, col, msg), *notes = said
    assert (path, line, col) == (str(user), *at(text, "kv in"))
    assert "'zz_child_f32'" in msg and len(notes) == 1


def test_a_user_file_named_with_the_spec_directory(tmp_path, capsys, monkeypatch):
    """``kgen check USER specs/``: the parents are named files, the error the user's."""
    monkeypatch.chdir(ROOT)
    text = child("qt_f32_causal", "tile_rows = 3")
    user, said = check_user(capsys, tmp_path, text, "specs")
    (kind, path, line, col, msg), *notes = said
    assert (path, line, col) == (str(user), *at(text, "tile_rows = 3"))
    micro = real()["qt_f32_causal"].settings("micro_rows")[-1]
    assert notes[0][1:4] == (micro.pos.path, micro.pos.line, micro.pos.col)


def test_json_says_the_notes(specs_copy, capsys):
    text = child("fc_attn_flash_prefill_q4", "kv = f32")
    user = specs_copy / "zz_user.kspec"
    user.write_text(text, encoding="utf-8")
    try:
        assert main(["check", "--json", str(user)]) == 2
    finally:
        user.unlink()
    got = json.loads(capsys.readouterr().out)["error"]
    assert (got["path"], got["line"], got["col"]) == (str(user), *at(text, "kv = f32"))
    ring = real()["fc_attn_flash_prefill_q4"].where("ring_floor")
    assert [(n["path"], n["line"], n["col"]) for n in got["notes"]] == [
        in_copy(ring, specs_copy)]


def test_subprocess_exit_code_and_no_traceback(specs_copy):
    user = specs_copy / "zz_user.kspec"
    text = child("qs_f32_causal_d256", "max_head_dim = 192")
    user.write_text(text, encoding="utf-8")
    try:
        proc = subprocess.run([sys.executable, "-m", "kgen", "check", str(user)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    finally:
        user.unlink()
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    line, col = at(text, "max_head_dim = 192")
    assert proc.stderr.startswith(f"{user}:{line}:{col}: error: ")
    assert f"\n{specs_copy}/qtile_swizzle.kspec:" in proc.stderr and ": note: " in proc.stderr


# -- a sweep: children of the spec tree's kernels, each changing one choice ----------------


@functools.cache
def _tree():
    files = expand(pipeline.parse([SPECS], ROOT))
    return files, {d.name: d for f in files for d in f.kernels}


def _context(name: str) -> list:
    """The spec files cut to the definitions ``name`` needs (its lineage, its relation
    targets and theirs): what checking a child of it reads."""
    files, defs = _tree()
    want, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n in want or n not in defs:
            continue
        want.add(n)
        d = defs[n]
        todo += [d.parent] if d.parent else []
        todo += [e.other for e in d.expects if isinstance(e, ExpectRelation)]
    return [replace(f, kernels=tuple(d for d in f.kernels if d.name in want)) for f in files]


def _shape(k) -> tuple:
    """What makes kernels check differently: one kernel of each shape is sampled."""
    return (k.op, k.mode, k.position, k.schedule, k.qtile_loads, k.lane_dims, k.stream_loads,
            k.key_split, k.k_stage, k.v_stage, k.pair.shadows, k.mixed, k.qk_split > 1,
            bool(k.relations))


def _values(key: str, now: object) -> list[str]:
    """Values a child may set ``key`` to: every other member, or a few integers."""
    t = KEYS[key].type
    if isinstance(t, type) and issubclass(t, Enum):
        return [m.value for m in t if m != now]
    return sorted({str(v) for v in (1, 3, 2 * now + 1 if isinstance(now, int) else 5)
                   if v != now})


def test_a_sweep_of_children_is_refused_in_the_childs_file():
    sample = {}
    for k in real().values():
        sample.setdefault(_shape(k), k)
    assert len(sample) == len({_shape(k) for k in real().values()})
    user_path = "/user/zz_user.kspec"
    refused: dict[str, int] = {}
    noted = 0
    for k in sample.values():
        context = _context(k.name)
        takes = get(k.op).spec_keys
        for key in sorted(takes - {"module", "doc", "op"}):
            for value in _values(key, getattr(k, key)):
                text = child(k.name, f"{key} = {value}")
                user = parse_spec(text, user_path)
                try:
                    pipeline.checked([user], context)
                    continue
                except SpecError as e:
                    err = e
                where = (err.pos.path, err.pos.line)
                assert err.pos.path == user_path, (k.name, key, value, err.render())
                assert where == (user_path, at(text, f"{key} = {value}")[0]) or \
                    where == (user_path, 1), (k.name, key, value, err.render())
                assert all(n.pos.path.startswith("specs/") for n in err.notes), err.render()
                contract = re.search(r"\[(check_\w+)\]$", err.message)
                name = contract[1] if contract else "resolve"
                refused[name] = refused.get(name, 0) + 1
                noted += bool(err.notes)
    # The sweep reaches the contracts that meet inherited choices, and their notes.
    assert {"check_schedule", "check_ring_floor", "check_expectations"} <= set(refused), refused
    assert noted > 0
