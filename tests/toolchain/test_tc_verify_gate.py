"""The verify gate catches what it exists to catch: one changed template token
makes exactly the affected kernels ``different`` with a readable SASS diff, and a
golden kernel that nothing generates is ``missing``. Kernels beyond the reference are
verified against their ``kgen freeze`` snapshot (golden/frozen.json); a kernel with no
golden at all is ``new`` and fails the gate unless ``--allow-new``; every count comes
from the specs and golden/."""

from __future__ import annotations

import re

import pytest

from kgen.compiler import pipeline
from kgen.compiler.golden import load_golden
from kgen.compiler.verify import COLUMN
from kgen.compiler.view import KernelView
from kgen.ir.axes import Op

pytestmark = pytest.mark.toolchain

# The slots decode path's sequence length (kernels/flash_parts.j2, request_span): only
# flash kernels with position = slots (and not prefill) render this line.
SLOTS_LINE = "const int seq_len = pos[slot] + 1;"
SLOTS_MUTANT = "const int seq_len = pos[slot] + 2;"
RIGHT = 2 + COLUMN + 3  # where the generated column starts in a diff row


def verdicts(output: str) -> dict[str, str]:
    """kernel -> verdict, from verify's table."""
    out = {}
    for line in output.splitlines():
        m = re.match(r"^(\w+)\s+(same|DIFF|-)\s+(same|DIFF|-)\s+.*\s(\w+)(?: \(frozen\))?$",
                     line)
        if m:
            out[m.group(1)] = m.group(4)
    return out


def kernels_of(ws) -> list:
    """The workspace's kernels, through the stages ``kgen check`` runs (the ws fixture
    points the settings at the workspace)."""
    ctx = pipeline.Context.load()
    return list(pipeline.run(("parse", "check"), pipeline.Work(inputs=(ws.specs,)), ctx).kernels)


def golden_names(ws) -> set[str]:
    """Every kernel verify has a golden for: the reference's and the frozen ones."""
    golden = load_golden(ws.golden)
    return set(golden.kernels) | set(golden.frozen)


def expected(ws, kernels, different=()) -> dict[str, str]:
    """The verdict each generated kernel should get: ``new`` without a golden."""
    golden = golden_names(ws)
    return {k.name: "new" if k.name not in golden else
            "different" if k.name in different else "identical" for k in kernels}


def compiled_sass(ws, name: str):
    ctx = pipeline.Context.load()
    work = pipeline.run(pipeline.VERIFY[:-1], pipeline.Work(inputs=(ctx.settings.specs,)), ctx)
    return work.compiled[name].sass


def test_unchanged_workspace_verifies_identical(ws):
    assert ws.kgen("build").rc == 0
    r = ws.kgen("verify")
    assert r.rc == 0, r.text
    kernels = kernels_of(ws)
    want = expected(ws, kernels)
    assert verdicts(r.out) == want
    n = len(golden_names(ws))
    assert sorted(k for k, v in want.items() if v != "new") == sorted(golden_names(ws))
    assert f"{n}/{n} identical" in r.out


def test_one_changed_template_token_is_caught_with_a_sass_diff(ws):
    ws.edit(ws.templates / "kernels" / "flash_parts.j2", SLOTS_LINE, SLOTS_MUTANT)
    kernels = kernels_of(ws)
    affected = sorted(k.name for k in kernels if k.op is Op.FLASH
                      and KernelView(k).slots and not KernelView(k).prefill)
    assert affected, "no kernel renders the mutated line; pick another token"

    b = ws.kgen("build")
    assert b.rc == 0, b.text
    r = ws.kgen("verify")
    assert r.rc == 1, r.text
    got = verdicts(r.out)
    assert got == expected(ws, kernels, different=affected)
    affected = [name for name in affected if name in golden_names(ws)]
    n = len(golden_names(ws))
    assert f"{n - len(affected)}/{n} identical, {len(affected)} different" in r.out

    golden = load_golden(ws.golden)
    frozen = [name for name in affected if name in golden.frozen]
    assert frozen, "a frozen kernel renders the mutated line too"
    for name in frozen:
        section = r.out.split(f"\n{name} (", 1)[1].split("\n\n", 1)[0]
        assert "differs from the frozen snapshot" in section and "kgen freeze" in section
    for name in sorted(set(affected) - set(frozen)):
        # Each affected kernel's section: a heading, then golden | generated rows.
        section = r.out.split(f"\n{name} (", 1)[1].split("\n\n", 1)[0]
        lines = section.splitlines()
        assert "SASS (" in lines[0] and f"kgen verify --diff {name}" in lines[0]
        header = lines[1]
        assert header.startswith("  golden") and header[RIGHT:] == "generated", header
        assert header[RIGHT - 2] == "|"
        rows = lines[2:]
        marked = [row for row in rows if len(row) > RIGHT - 2 and row[RIGHT - 2] == "|"]
        assert marked, section
        # Differing rows show real SASS on at least one side.
        assert any(row[2:RIGHT - 3].strip() and row[RIGHT:].strip() for row in marked)
        # The first-difference view is bounded; --diff has the rest.
        assert len(rows) <= 45, f"{name}: {len(rows)} rows in the verify report"
        left = [row[2:RIGHT - 3].strip() for row in rows if not row.startswith("  ...")]
        golden_shown = {f"{i.addr:04x} {i.text}" for i in golden.sass[name] if i.addr is not None}
        assert any(x in golden_shown for x in left if x)

    # Unaffected kernels have no diff section.
    assert "\nfc_attn_qz_split (" not in r.out


def test_verify_diff_prints_the_whole_aligned_diff(ws):
    ws.edit(ws.templates / "kernels" / "flash_parts.j2", SLOTS_LINE, SLOTS_MUTANT)
    assert ws.kgen("build").rc == 0
    name = "fc_attn_flash_decode_slots"
    r = ws.kgen("verify", "--diff", name)
    assert r.rc == 1, r.text
    lines = r.out.rstrip("\n").splitlines()
    assert lines[0].startswith("  golden") and lines[0][RIGHT:] == "generated"
    rows = lines[1:]
    golden = load_golden(ws.golden).sass[name]
    generated = compiled_sass(ws, name)

    def shown(i):
        return f"{i.addr:04x} {i.text}" if i.addr is not None else f"(ctrl {i.encoding})"

    # Every word of both streams appears, in order, in its own column.
    left = [row[2:RIGHT - 3].strip() for row in rows]
    right = [row[RIGHT:].strip() for row in rows]
    assert [x for x in left if x] == [shown(i)[:COLUMN].strip() for i in golden]
    assert [y for y in right if y] == [shown(i)[:COLUMN].strip() for i in generated]
    # Rows are marked exactly where the aligned words differ.
    marks = [len(row) > RIGHT - 2 and row[RIGHT - 2] == "|" for row in rows]
    assert any(marks) and not all(marks)
    for row, marked, x, y in zip(rows, marks, left, right, strict=True):
        if not marked:
            assert x and y and x.split(" ", 1)[-1] == y.split(" ", 1)[-1], row


def test_verify_diff_of_an_identical_kernel_is_clean(ws):
    assert ws.kgen("build").rc == 0
    r = ws.kgen("verify", "--diff", "fc_attn_qz_split")
    assert r.rc == 0, r.text
    rows = r.out.splitlines()[1:]
    assert rows and not any(len(row) > RIGHT - 2 and row[RIGHT - 2] == "|" for row in rows)


def test_a_golden_kernel_nothing_generates_is_missing(ws):
    gone = "fc_attn_kv_append_slots_q4"
    spec = ws.specs / "append.kspec"
    text = spec.read_text()
    block = re.search(rf"^kernel {gone} :.*?^}}\n", text, re.M | re.S)
    assert block, f"{gone} not found in {spec}"
    spec.write_text(text.replace(block.group(0), ""))
    assert gone not in [k.name for k in kernels_of(ws)]

    b = ws.kgen("build")
    assert b.rc == 0, b.text
    r = ws.kgen("verify")
    assert r.rc == 1, r.text
    got = verdicts(r.out)
    assert got[gone] == "missing"
    assert {k: v for k, v in got.items() if k != gone} == expected(ws, kernels_of(ws))
    n = len(golden_names(ws))
    assert f"{n - 1}/{n} identical, 1 missing" in r.out

    only = ws.kgen("verify", gone)
    assert only.rc == 1 and verdicts(only.out) == {gone: "missing"}


def test_kernels_without_golden_fail_the_gate_until_frozen(ws):
    """A spec file of new kernels (in a module of its own, one from a family) builds;
    verify reports them ``new`` and fails (passes with --allow-new); ``kgen freeze``
    snapshots them, and then a change of their code is caught."""
    (ws.specs / "zz_new.kspec").write_text(
        "kernel fc_new_combine_{position} : fc_attn_flash_decode_combine"
        " for position in [host, device] {\n    module = attn_new\n}\n", encoding="utf-8")
    b = ws.kgen("build")
    assert b.rc == 0, b.text
    assert {f"src/{n}.cu" for n in ("fc_new_combine_host", "fc_new_combine_device")} <= set(
        ws.tree("generated"))
    r = ws.kgen("verify")
    assert r.rc == 1, r.text
    kernels = kernels_of(ws)
    new = {"fc_new_combine_host", "fc_new_combine_device"}
    assert new <= {k.name for k in kernels}
    assert verdicts(r.out) == expected(ws, kernels)
    assert {verdicts(r.out)[name] for name in new} == {"new"}
    n = len(golden_names(ws))
    assert f"{n}/{n} identical, 2 new (no golden: review, then `kgen freeze`)" in r.out
    assert ws.kgen("verify", "--allow-new").rc == 0

    f = ws.kgen("freeze", "fc_new_combine_host")
    assert f.rc == 0, f.text
    assert "added: fc_new_combine_host" in f.out
    assert verdicts(ws.kgen("verify").out)["fc_new_combine_host"] == "identical"
    assert ws.kgen("verify").rc == 1  # the other one is still new
    assert ws.kgen("freeze").rc == 0
    r = ws.kgen("verify")
    assert r.rc == 0, r.text
    assert f"{n + 2}/{n + 2} identical" in r.out

    # A frozen kernel whose code changes fails the gate, naming the snapshot.
    ws.edit(ws.specs / "zz_new.kspec", "module = attn_new", "module = attn_new\n"
            "    tile_keys = 32")
    assert ws.kgen("build").rc == 0
    r = ws.kgen("verify", "fc_new_combine_device")
    assert r.rc == 1, r.text
    assert verdicts(r.out) == {"fc_new_combine_device": "different"}
    assert "differs from the frozen snapshot" in r.out


def test_verify_unknown_kernel_answers_before_compiling(ws):
    r = ws.kgen("verify", "fc_attn_flash_prefil")
    assert r.rc == 1
    assert "did you mean 'fc_attn_flash_prefill'?" in r.err
    assert "ptx" not in r.err  # no compile progress before the answer
