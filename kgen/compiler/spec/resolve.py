"""Stage ``resolve``: spec files -> ``Kernel`` IR (inheritance, keys, values).

Errors here are about names: duplicate or unknown kernels, inheritance cycles,
unknown keys and values (each with a "did you mean").
"""

from __future__ import annotations

from dataclasses import replace
from enum import Enum

from kgen.compiler.spec.ast import Assign, ExpectRelation, ExpectResource, KernelDef, SpecFile
from kgen.compiler.spec.expand import expand
from kgen.errors import SourcePos, SpecError, did_you_mean
from kgen.ir.axes import KEYS
from kgen.ir.kernel import Kernel, Setting


class _Lines:
    """Source lines of every spec file, for carets under errors."""

    def __init__(self, files: list[SpecFile]):
        self.by_path = {f.path: f.lines for f in files}

    def error(self, pos: SourcePos, msg: str) -> SpecError:
        lines = self.by_path.get(pos.path, ())
        src = lines[pos.line - 1] if 0 < pos.line <= len(lines) else None
        return SpecError(pos, msg, src)


def _convert(a: Assign, lines: _Lines) -> object:
    key = KEYS.get(a.key)
    if key is None:
        raise lines.error(a.pos, f"unknown key '{a.key}'" + did_you_mean(a.key, sorted(KEYS)))
    t = key.type
    if isinstance(t, type) and issubclass(t, Enum):
        values = [m.value for m in t]
        if a.value not in values:
            raise lines.error(
                a.value_pos,
                f"'{a.value}' is not a value of '{a.key}'; expected one of "
                + ", ".join(values) + did_you_mean(str(a.value), values),
            )
        return t(a.value)
    if t is int:
        if not isinstance(a.value, int):
            raise lines.error(a.value_pos, f"'{a.key}' takes an integer, not '{a.value}'")
        if a.value < key.lo:
            raise lines.error(a.value_pos, f"'{a.key}' must be positive, not {a.value}"
                              if key.lo == 1 else f"'{a.key}' is at least {key.lo}, not "
                              f"{a.value}")
        if key.hi is not None and a.value > key.hi:
            raise lines.error(a.value_pos, f"'{a.key}' is at most {key.hi}, not {a.value} "
                              f"({key.hi_why})")
        return a.value
    if isinstance(a.value, int):
        raise lines.error(a.value_pos, f"'{a.key}' takes a name or a string, not {a.value}")
    return a.value


class _Inherited:
    """What a kernel has so far, root first: each level of its lineage adds to it."""

    def __init__(self):
        self.values: dict[str, object] = {}
        self.origin: dict[str, list[Setting]] = {}  # every assignment of a key, root first
        self.budgets: dict[tuple[str, str], ExpectResource] = {}
        self.relations: dict[tuple[str, str], ExpectRelation] = {}


def _definitions(files: list[SpecFile], lines: _Lines) -> dict[str, KernelDef]:
    defs: dict[str, KernelDef] = {}
    for f in files:
        for d in f.kernels:
            first = defs.get(d.name)
            if first is not None:
                raise lines.error(
                    d.pos, f"kernel '{d.name}' is defined twice (first at {first.pos})"
                )
            defs[d.name] = d
    return defs


def _chain(d: KernelDef, defs: dict[str, KernelDef], lines: _Lines) -> list[KernelDef]:
    """The kernel, its parent, ... up to a root."""
    seen = [d]
    names = {d.name}  # a set of names: comparing definitions is slow and made check O(n^2)
    while seen[-1].parent is not None:
        cur = seen[-1]
        parent = defs.get(cur.parent)
        if parent is None:
            raise lines.error(
                cur.parent_pos or cur.pos,
                f"'{cur.name}' inherits from unknown kernel '{cur.parent}'"
                + did_you_mean(cur.parent, sorted(defs)),
            )
        if parent.name in names:
            first = next(i for i, k in enumerate(seen) if k.name == parent.name)
            cycle = " -> ".join([*(k.name for k in seen[first:]), parent.name])
            raise lines.error(cur.parent_pos or cur.pos, f"inheritance cycle: {cycle}")
        seen.append(parent)
        names.add(parent.name)
    return seen


def _said(kind: str, target: str) -> str:
    """A relation or budget as written in a spec."""
    if kind == "resource":
        return f"expect {target}"
    return f"expect {'bit_exact with' if kind == 'bit_exact' else kind} {target}"


def _assign(level: KernelDef, acc: _Inherited, lines: _Lines) -> None:
    own: set[str] = set()
    for a in level.assigns:
        if a.key in own:
            raise lines.error(a.pos, f"'{a.key}' is set twice in '{level.name}'")
        own.add(a.key)
        acc.values[a.key] = value = _convert(a, lines)
        acc.origin.setdefault(a.key, []).append(Setting(value, a.pos, level.name))


def _drop(level: KernelDef, acc: _Inherited, lines: _Lines) -> None:
    """``drop expect ...`` removes what the parents set; dropping anything else is a
    mistake worth reporting (a typo, or a parent that changed)."""
    seen: set[tuple[str, str]] = set()
    for x in level.drops:
        said = "drop " + _said(x.kind, x.target)
        if (x.kind, x.target) in seen:
            raise lines.error(x.pos, f"'{said}' is written twice in '{level.name}'")
        seen.add((x.kind, x.target))
        if x.kind == "resource":
            gone = [key for key, b in acc.budgets.items() if b.resource == x.target]
        else:
            gone = [key for key in acc.relations if key == (x.kind, x.target)]
        if not gone:
            what = (f"no '{x.target}' budget" if x.kind == "resource"
                    else f"no '{_said(x.kind, x.target)}'")
            raise lines.error(x.pos, f"'{level.name}' inherits {what} to drop")
        for key in gone:
            del (acc.budgets if x.kind == "resource" else acc.relations)[key]


def _expect(level: KernelDef, acc: _Inherited, defs: dict[str, KernelDef],
            lines: _Lines) -> None:
    own: set[tuple[str, str]] = set()
    for e in level.expects:
        if isinstance(e, ExpectResource):
            if (e.resource, e.op) in own:
                raise lines.error(e.pos, f"a '{e.resource} {e.op}' budget is set "
                                  f"twice in '{level.name}'")
            own.add((e.resource, e.op))
            # The same resource and comparison replaces the parent's (tighter or looser).
            acc.budgets[(e.resource, e.op)] = replace(e, owner=level.name)
            continue
        if (e.kind, e.other) in own:
            raise lines.error(e.pos, f"'{_said(e.kind, e.other)}' is set twice "
                              f"in '{level.name}'")
        own.add((e.kind, e.other))
        if e.other == level.name:
            raise lines.error(e.pos, f"'{level.name}' is compared with itself")
        other = defs.get(e.other)
        if other is not None and other.abstract:
            raise lines.error(e.pos, f"'{e.other}' is abstract: it has no outputs "
                              "to compare with")
        acc.relations[(e.kind, e.other)] = replace(e, owner=level.name)


def resolve(files: list[SpecFile]) -> list[Kernel]:
    """Every concrete kernel of ``files`` (families expanded), in definition order."""
    files = expand(files)
    lines = _Lines(files)
    defs = _definitions(files, lines)
    kernels = []
    for d in defs.values():
        lineage = _chain(d, defs, lines)
        acc = _Inherited()
        for level in reversed(lineage):  # root first, so the kernel's own word wins
            _assign(level, acc, lines)
            _drop(level, acc, lines)
            _expect(level, acc, defs, lines)
        if d.abstract:
            continue
        for required in ("op", "module"):
            if required not in acc.values:
                raise lines.error(d.pos, f"kernel '{d.name}' does not say its '{required}' "
                                  f"(set it here or in a parent)")
        fields = {k: acc.values.get(k, spec.default) for k, spec in KEYS.items()}
        if fields["v_kv"] is None:  # V rows in K's format unless the spec says otherwise
            fields["v_kv"] = fields["kv"]
        kernels.append(Kernel(
            name=d.name,
            budgets=tuple(acc.budgets.values()),
            # A parent's relation to this very kernel is moot.
            relations=tuple(r for r in acc.relations.values() if r.other != d.name),
            lineage=tuple(k.name for k in lineage),
            spec_path=d.pos.path,
            pos=d.pos,
            origin=tuple((key, tuple(chain)) for key, chain in acc.origin.items()),
            **fields,
        ))
    return kernels
