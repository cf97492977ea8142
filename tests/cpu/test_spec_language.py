"""What the spec language means: budget overrides, drops and families, on small specs.

The mistakes each construct can make are the fixtures in tests/fixtures/invalid
(test_spec_errors.py); here, valid specs resolve to the kernels they say.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from kgen.compiler.pipeline import checked, parse
from kgen.compiler.spec.parser import parse_spec
from kgen.errors import SourcePos, SpecError
from kgen.formats import FORMATS, KvFormatName
from kgen.ir.axes import Mode, Op, Position

ROOT = Path(__file__).resolve().parents[2]

BASE = """\
abstract kernel base {
    module = m
    op = flash
    mode = decode
    expect registers <= 64
    expect registers >= 8
    expect stack_frame == 0
}
"""


def kernels(text: str, path: str = "t.kspec") -> dict:
    return {k.name: k for k in checked([parse_spec(textwrap.dedent(text), path)])}


def budgets(k) -> set[tuple[str, str, int]]:
    return {(b.resource, b.op, b.value) for b in k.budgets}


def relations(k) -> set[tuple[str, str]]:
    return {(r.kind, r.other) for r in k.relations}


# -- overriding and dropping what a parent expects ---------------------------------------


def test_a_child_tightens_or_loosens_an_inherited_budget():
    ks = kernels(BASE + """
kernel tight : base { expect registers <= 40 }
kernel loose : base { expect registers <= 80 }
kernel grandchild : loose { }
""")
    assert budgets(ks["tight"]) == {("registers", "<=", 40), ("registers", ">=", 8),
                                    ("stack_frame", "==", 0)}
    assert budgets(ks["loose"]) >= {("registers", "<=", 80)}
    assert ("registers", "<=", 64) not in budgets(ks["loose"])
    assert budgets(ks["grandchild"]) == budgets(ks["loose"])


def test_each_budget_knows_the_kernel_that_set_it():
    ks = kernels(BASE + "kernel a : base { expect registers <= 80 }\nkernel b : a { }\n")
    owners = {(b.resource, b.op): b.owner for b in ks["b"].budgets}
    assert owners == {("registers", "<="): "a", ("registers", ">="): "base",
                      ("stack_frame", "=="): "base"}
    # The owner is bookkeeping: kernels that expect the same compare equal.
    flat = kernels("""
kernel b { module = m op = flash mode = decode expect registers >= 8
           expect registers <= 80 expect stack_frame == 0 }
""")["b"]
    assert set(ks["b"].budgets) == set(flat.budgets)


def test_drop_removes_every_inherited_budget_on_a_resource():
    ks = kernels(BASE + """
kernel loose : base { drop expect registers }
kernel again : base {
    drop expect registers
    expect registers <= 100
}
kernel child : loose { }
""")
    assert budgets(ks["loose"]) == {("stack_frame", "==", 0)}
    assert budgets(ks["again"]) == {("registers", "<=", 100), ("stack_frame", "==", 0)}
    assert budgets(ks["child"]) == budgets(ks["loose"])


def test_drop_removes_an_inherited_relation_only():
    ks = kernels(BASE + """
kernel ref : base { }
kernel other : base { }
abstract kernel related : base {
    expect bit_exact with ref
    expect close_to other within 1e-3
}
kernel a : related { drop expect bit_exact with ref }
kernel b : related { drop expect close_to other }
kernel c : related {
    drop expect close_to other
    expect close_to other within 1e-2
}
""")
    assert relations(ks["a"]) == {("close_to", "other")}
    assert relations(ks["b"]) == {("bit_exact", "ref")}
    (tol,) = [r.tolerance for r in ks["c"].relations if r.kind == "close_to"]
    assert tol == 1e-2


def test_a_relation_a_parent_holds_to_this_very_kernel_can_be_dropped():
    ks = kernels(BASE + """
kernel a : base { expect bit_exact with b }
kernel b : a { drop expect bit_exact with b }
""")
    assert relations(ks["a"]) == {("bit_exact", "b")}
    assert relations(ks["b"]) == set()


# -- families -------------------------------------------------------------------------

FAMILY = BASE + """
kernel ref_{kv}_{position} : base for kv in [f32, q4], position in [host, device] { }

kernel dec_{kv}_{position} : base for kv in [f32, q4], position in [host, device] {
    doc = "split decode over {kv}, position {position}"
    expect registers <= 80
    expect bit_exact with ref_{kv}_{position}
}
"""


def test_a_family_is_the_product_of_its_bindings_in_the_order_written():
    ks = kernels(FAMILY)
    names = [n for n in ks if n.startswith("dec_")]
    assert names == ["dec_f32_host", "dec_f32_device", "dec_q4_host", "dec_q4_device"]
    k = ks["dec_q4_device"]
    assert (k.kv, k.position) == (KvFormatName("q4"), Position.DEVICE)
    assert k.doc == "split decode over q4, position device"
    assert relations(k) == {("bit_exact", "ref_q4_device")}
    assert ("registers", "<=", 80) in budgets(k)
    assert {b.owner for b in k.budgets if b.resource == "registers" and b.op == "<="} == {
        "dec_q4_device"}


def test_a_bound_key_comes_from_its_binding():
    k = kernels(FAMILY)["dec_q4_device"]
    line = FAMILY.split("\n").index(
        "kernel dec_{kv}_{position} : base for kv in [f32, q4], position in [host, device] {")
    head = FAMILY.split("\n")[line]
    assert k.where("kv") == SourcePos("t.kspec", line + 1, head.index("kv in") + 1)
    assert k.where("position") == SourcePos("t.kspec", line + 1, head.index("position in") + 1)
    assert k.pos == SourcePos("t.kspec", line + 1, head.index("dec_") + 1)
    assert {"kv", "position"} <= k.explicit_keys


def test_a_family_equals_its_kernels_written_out():
    family = kernels(BASE + """
kernel k_{kv} : base for kv in [f32, q4] {
    doc = "over {kv}"
    tile_keys = 16
}
""")
    by_hand = kernels(BASE + """
kernel k_f32 : base { kv = f32 doc = "over f32" tile_keys = 16 }
kernel k_q4 : base { kv = q4 doc = "over q4" tile_keys = 16 }
""")
    assert list(family) == list(by_hand)
    for name in family:
        assert dataclasses.replace(family[name], lineage=()) == dataclasses.replace(
            by_hand[name], lineage=())


def test_abstract_families_integer_values_and_patterned_parents():
    ks = kernels(BASE + """
abstract kernel grouped_{max_groups} : base for max_groups in [4, 8] {
    doc = "up to {max_groups} groups"
}
kernel k_{max_groups}_{kv} : grouped_{max_groups} for max_groups in [4, 8], kv in [q4] {
    module = m_{kv}
}
""")
    assert list(ks) == ["k_4_q4", "k_8_q4"]
    k = ks["k_8_q4"]
    assert (k.max_groups, k.kv, k.module) == (8, KvFormatName("q4"), "m_q4")
    assert k.lineage == ("k_8_q4", "grouped_8", "base")
    assert k.doc == "up to 8 groups"


def test_braces_in_a_string_outside_a_family_are_text():
    (k,) = kernels(BASE + 'kernel k : base { doc = "a {literal} brace" }\n').values()
    assert k.doc == "a {literal} brace"


# -- sets -----------------------------------------------------------------------------

def kv_of(ks: dict, prefix: str) -> list[str]:
    return [k.kv.value for name, k in ks.items() if name.startswith(prefix)]


def test_formats_is_every_registered_format_in_registry_order():
    ks = kernels(BASE + "kernel k_{kv} : base for kv in formats { }\n")
    assert list(ks) == [f"k_{name}" for name in FORMATS]
    written = kernels(BASE + f"kernel k_{{kv}} : base for kv in [{', '.join(FORMATS)}] {{ }}\n")
    assert ks == written


def test_where_keeps_the_members_with_or_without_a_property_in_order():
    ks = kernels(BASE + """
kernel plain_{kv} : base for kv in formats where not shadows { }
kernel shadowed_{kv} : base for kv in formats where shadows { }
kernel both_{kv} : base for kv in formats where not shadows where not blocked { }
""")
    assert kv_of(ks, "plain_") == [n for n, f in FORMATS.items() if not f.shadows]
    assert kv_of(ks, "shadowed_") == [n for n, f in FORMATS.items() if f.shadows]
    assert kv_of(ks, "both_") == [n for n, f in FORMATS.items()
                                  if not f.shadows and not f.blocked]


def test_minus_takes_values_out_and_keeps_the_left_order():
    ks = kernels(BASE + """
kernel a_{kv} : base for kv in formats - [q4] { }
kernel b_{kv} : base for kv in formats - [q4] - [f32] { }
kernel c_{max_groups} : base for max_groups in [8, 4, 2] - [4] { }
""")
    assert kv_of(ks, "a_") == [n for n in FORMATS if n != "q4"]
    assert kv_of(ks, "b_") == [n for n in FORMATS if n not in ("q4", "f32")]
    assert [k.max_groups for name, k in ks.items() if name.startswith("c_")] == [8, 2]


def test_declared_sets_serve_every_family_of_their_file_and_later_sets():
    ks = kernels("""
set plain = formats where not shadows
set few = plain - [f32]
set groups = [4, 8]
""" + BASE + """
kernel p_{kv} : base for kv in plain { }
kernel f_{kv}_{max_groups} : base for kv in few, max_groups in groups { }
""")
    plain = [n for n, f in FORMATS.items() if not f.shadows]
    assert kv_of(ks, "p_") == plain
    assert [n for n in ks if n.startswith("f_")] == [
        f"f_{kv}_{g}" for kv in plain if kv != "f32" for g in (4, 8)]


def test_a_set_bound_value_comes_from_its_binding():
    text = BASE + "set plain = formats where not shadows\n" \
        "kernel p_{kv} : base for kv in plain { }\n"
    k = kernels(text)["p_f16"]
    line = text.split("\n").index("kernel p_{kv} : base for kv in plain { }")
    head = text.split("\n")[line]
    assert k.where("kv") == SourcePos("t.kspec", line + 1, head.index("kv in") + 1)


def test_a_declared_set_belongs_to_its_file():
    decl = parse_spec("set plain = formats where not shadows\n" + BASE, "a.kspec")
    use = parse_spec("kernel p_{kv} : base for kv in plain { }\n", "b.kspec")
    with pytest.raises(SpecError, match=r"unknown set 'plain'"):
        checked([decl, use])


def test_every_format_serves_every_head_size_family():
    """The real specs: a registered format has the narrow-tile kernels (head_dim 64 and
    up) of prefill and of decode at every dense position form, and every format
    without shadows has the paged kernels."""
    real = checked(parse([ROOT / "specs"]))
    for name, fmt in FORMATS.items():
        ours = [k for k in real if k.kv.value == name and k.op is Op.FLASH]
        assert any(k.mode is Mode.PREFILL and k.tile_keys == 4 for k in ours), name
        for pos in (Position.HOST, Position.DEVICE, Position.SLOTS):
            assert any(k.mode is Mode.DECODE and k.position is pos and k.tile_keys == 4
                       for k in ours), (name, pos)
        assert any(k.position is Position.PAGED for k in ours) != fmt.shadows, name


def test_a_deep_inheritance_chain_resolves_in_linear_comparisons(monkeypatch):
    """``kgen check`` walked each kernel's chain comparing whole definitions, so a
    chain of n kernels cost ~n^3/6 deep comparisons (1000: 31 s, 2000: 130 s)."""
    from kgen.compiler.spec import ast as spec_ast

    n = 600
    text = "kernel c0 { module = deep op = qz_split }\n" + "".join(
        f"kernel c{i} : c{i - 1} {{ }}\n" for i in range(1, n))
    calls = [0]
    real_eq = spec_ast.KernelDef.__eq__

    def counting(self, other):
        calls[0] += 1
        return real_eq(self, other)

    monkeypatch.setattr(spec_ast.KernelDef, "__eq__", counting)
    kernels = checked([parse_spec(text, "deep.kspec")])
    assert [k.name for k in kernels][-1] == f"c{n - 1}" and len(kernels[-1].lineage) == n
    assert calls[0] < 10 * n, calls[0]


def test_an_inherited_combination_is_refused_at_the_line_that_made_it():
    """The parent (another file) sets schedule = warp_stream for a prefill; the child's
    position = slots makes the combination the schedule refuses (its per-slot form is
    a decode): the error is at the child's line."""
    parent = parse_spec("kernel ws_parent { module = m op = flash mode = prefill\n"
                        "    schedule = warp_stream k_stage = registers dot_lanes = 32\n"
                        "    kreg_max_chunk = 8 }\n", "parent.kspec")
    child = parse_spec("kernel ws_child : ws_parent {\n    position = slots\n"
                       "    module = m_child\n}\n", "child.kspec")
    with pytest.raises(SpecError) as e:
        checked([parent, child])
    assert (e.value.pos.path, e.value.pos.line) == ("child.kspec", 2), e.value.render()
    rows = parse_spec("kernel r_parent { module = m op = flash mode = prefill\n"
                      "    rows_per_block = 2 }\n", "rows.kspec")
    rchild = parse_spec("kernel r_child : r_parent {\n    window = exact\n    module = m_w\n}\n",
                        "w.kspec")
    with pytest.raises(SpecError, match="does not combine with window = exact yet") as e:
        checked([rows, rchild])
    assert (e.value.pos.path, e.value.pos.line) == ("w.kspec", 2)
