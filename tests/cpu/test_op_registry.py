"""The op registry (kgen.ops) is the one place that knows an op: every op of the spec
language is registered there, and no module outside kgen/ops decides anything by an op's
name (a comparison with an ``Op`` member, a membership test among them, or a table keyed
by them). Naming an op to ask for a kernel (a role, ``Role(Op.X, ...)``) is no decision."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kgen import ops
from kgen.ir.axes import KEYS, Op

ROOT = Path(__file__).resolve().parents[2] / "kgen"


def _is_op_member(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "Op" and node.attr.isupper())


def _members(node: ast.AST) -> bool:
    """An Op member, or a tuple, list or set literal holding one."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_is_op_member(e) for e in node.elts)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id in ("frozenset", "set", "tuple"):
        return any(_members(a) for a in node.args)
    return _is_op_member(node)


def switches(source: str, path: str) -> list[str]:
    """Where ``source`` decides by an op: ``x is Op.A``, ``x in (Op.A, Op.B)``,
    ``{Op.A: ...}``, a collection of ops (``frozenset({Op.A})``, ``(Op.A, Op.B)``)."""
    out = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Compare) and any(
                _members(n) for n in (node.left, *node.comparators)):
            out.append(f"{path}:{node.lineno}: compares with an op")
        elif isinstance(node, ast.Dict) and any(k is not None and _is_op_member(k)
                                                for k in node.keys):
            out.append(f"{path}:{node.lineno}: a table keyed by ops")
        elif isinstance(node, ast.Tuple | ast.List | ast.Set) and _members(node):
            out.append(f"{path}:{node.lineno}: a collection of ops")
    return out


def test_no_module_outside_the_registry_switches_on_an_op():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent == ROOT / "ops":
            continue
        found += switches(path.read_text(), str(path.relative_to(ROOT.parent)))
    assert not found, "decided by an op's name outside kgen/ops:\n" + "\n".join(found)


@pytest.mark.parametrize("source, hits", [
    ("if k.op is Op.FLASH: pass", 1),
    ("x = k.op in (Op.FLASH, Op.KV_APPEND)", 2),  # the test, and the tuple it holds
    ("t = {Op.FLASH: 1}", 1),
    ("S = frozenset({Op.MLA_STORE})", 1),
    ("S = (Op.MLA_STORE, Op.MLA_GATHER)", 1),
    ("r = Role(Op.FLASH, Position.HOST)", 0),  # a request names its op
    ("if k.op is op: pass", 0),
])
def test_the_switch_finder(source, hits):
    assert len(switches(source, "x.py")) == hits


def test_every_op_is_registered_once():
    assert list(ops.OPS) == [o for o in ops.OPS] and set(ops.OPS) == set(Op)
    for op, d in ops.OPS.items():
        assert d.op is op and ops.get(op.value) is d and isinstance(d, ops.OpDef)


def test_every_spec_key_an_op_takes_is_a_key():
    for d in ops.OPS.values():
        assert d.spec_keys <= KEYS.keys(), d
