"""Stage ``resolve``: spec files -> ``Kernel`` IR (inheritance, keys, values).

Errors here are about names: duplicate or unknown kernels, inheritance cycles,
unknown keys and values (each with a "did you mean").
"""

from __future__ import annotations

import difflib
from enum import Enum

from kgen.errors import SourcePos, SpecError
from kgen.spec.ast import Assign, ExpectRelation, ExpectResource, KernelDef, SpecFile
from kgen.spec.axes import KEYS
from kgen.spec.ir import Kernel


class _Lines:
    """Source lines of every spec file, for carets under errors."""

    def __init__(self, files: list[SpecFile]):
        self.by_path = {f.path: f.lines for f in files}

    def error(self, pos: SourcePos, msg: str) -> SpecError:
        lines = self.by_path.get(pos.path, ())
        src = lines[pos.line - 1] if 0 < pos.line <= len(lines) else None
        return SpecError(pos, msg, src)


def did_you_mean(word: str, known: list[str]) -> str:
    guess = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f" (did you mean '{guess[0]}'?)" if guess else ""


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
        if a.value <= 0:
            raise lines.error(a.value_pos, f"'{a.key}' must be positive, not {a.value}")
        return a.value
    if isinstance(a.value, int):
        raise lines.error(a.value_pos, f"'{a.key}' takes a name or a string, not {a.value}")
    return a.value


def resolve(files: list[SpecFile]) -> list[Kernel]:
    """Every concrete kernel of ``files``, in definition order."""
    lines = _Lines(files)
    defs: dict[str, KernelDef] = {}
    for f in files:
        for d in f.kernels:
            first = defs.get(d.name)
            if first is not None:
                raise lines.error(
                    d.pos, f"kernel '{d.name}' is defined twice (first at {first.pos})"
                )
            defs[d.name] = d

    def chain(d: KernelDef) -> list[KernelDef]:
        seen = [d]
        while seen[-1].parent is not None:
            cur = seen[-1]
            parent = defs.get(cur.parent)
            if parent is None:
                raise lines.error(
                    cur.parent_pos or cur.pos,
                    f"'{cur.name}' inherits from unknown kernel '{cur.parent}'"
                    + did_you_mean(cur.parent, sorted(defs)),
                )
            if parent in seen:
                cycle = " -> ".join([*(k.name for k in seen[seen.index(parent):]), parent.name])
                raise lines.error(cur.parent_pos or cur.pos, f"inheritance cycle: {cycle}")
            seen.append(parent)
        return seen

    kernels = []
    for d in defs.values():
        lineage = chain(d)
        values: dict[str, object] = {}
        origin: dict[str, SourcePos] = {}
        budgets: dict[str, ExpectResource] = {}
        relations: dict[tuple[str, str], ExpectRelation] = {}
        for level in reversed(lineage):  # root first, so the kernel's own word wins
            own: set[str] = set()
            for a in level.assigns:
                if a.key in own:
                    raise lines.error(a.pos, f"'{a.key}' is set twice in '{level.name}'")
                own.add(a.key)
                values[a.key] = _convert(a, lines)
                origin[a.key] = a.pos
            own_expects: set[tuple[str, str]] = set()
            for e in level.expects:
                if isinstance(e, ExpectResource):
                    if (e.resource, e.op) in own_expects:
                        raise lines.error(e.pos, f"a '{e.resource} {e.op}' budget is set "
                                          f"twice in '{level.name}'")
                    own_expects.add((e.resource, e.op))
                    budgets[f"{e.resource}{e.op}"] = e
                    continue
                if (e.kind, e.other) in own_expects:
                    said = "bit_exact with" if e.kind == "bit_exact" else e.kind
                    raise lines.error(e.pos, f"'expect {said} {e.other}' is set twice "
                                      f"in '{level.name}'")
                own_expects.add((e.kind, e.other))
                if e.other == level.name:
                    raise lines.error(e.pos, f"'{level.name}' is compared with itself")
                other = defs.get(e.other)
                if other is not None and other.abstract:
                    raise lines.error(e.pos, f"'{e.other}' is abstract: it has no outputs "
                                      "to compare with")
                if e.other != d.name:  # a parent's relation to this very kernel is moot
                    relations[(e.kind, e.other)] = e
        if d.abstract:
            continue
        for required in ("op", "module"):
            if required not in values:
                raise lines.error(d.pos, f"kernel '{d.name}' does not say its '{required}' "
                                  f"(set it here or in a parent)")
        fields = {k: values.get(k, spec.default) for k, spec in KEYS.items()}
        kernels.append(Kernel(
            name=d.name,
            budgets=tuple(budgets.values()),
            relations=tuple(relations.values()),
            lineage=tuple(k.name for k in lineage),
            spec_path=d.pos.path,
            pos=d.pos,
            origin=tuple(origin.items()),
            **fields,
        ))
    return kernels
