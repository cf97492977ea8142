"""Family expansion, the step before ``resolve``: a definition with a ``for`` clause
becomes one concrete definition per combination of its bindings.

    kernel fc_{kv}_{position} : base for kv in [f32, q4], position in [host, device] { ... }

Combinations are the cartesian product, first binding outermost. Each binding sets
its key as if assigned in the body (the binding's key is the origin of the value,
the listed value is where a bad value is reported); ``{key}`` in the name, the
parent, relation and drop targets and string values is replaced by the value.
Whether a value is valid for its key is resolve's question, asked per kernel.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

from kgen.compiler.spec.ast import Assign, Binding, Bound, ExpectRelation, KernelDef, SpecFile
from kgen.errors import SourcePos, SpecError

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand(files: list[SpecFile]) -> list[SpecFile]:
    """Every file with its families expanded (files without one are returned as is)."""
    return [expand_file(f) for f in files]


def expand_file(f: SpecFile) -> SpecFile:
    lines = f.lines

    def error(pos: SourcePos, msg: str) -> SpecError:
        return SpecError(pos, msg, lines[pos.line - 1] if 0 < pos.line <= len(lines) else None)

    if not any(d.family for d in f.kernels) and not _any_patterns(f):
        return f  # the common case: nothing to expand or reject
    out: list[KernelDef] = []
    for d in f.kernels:
        out += _expand_def(d, lines, error) if d.family else [_no_family(d, error)]
    return replace(f, kernels=tuple(out))


def _any_patterns(f: SpecFile) -> bool:
    return any(text and "{" in text for d in f.kernels for text, _ in _names(d))


def _names(d: KernelDef) -> list[tuple[str | None, SourcePos | None]]:
    """The name-like places a placeholder may stand in, with their positions."""
    return [(d.name, d.pos), (d.parent, d.parent_pos),
            *((e.other, e.pos) for e in d.expects if isinstance(e, ExpectRelation)),
            *((x.target, x.pos) for x in d.drops if x.kind != "resource")]


def _placeholders(text: str, pos: SourcePos, skip: int = 0):
    """(key, position of its '{') for each placeholder in ``text`` written at ``pos``."""
    for m in PLACEHOLDER.finditer(text):
        yield m[1], SourcePos(pos.path, pos.line, pos.col + skip + m.start())


def _no_family(d: KernelDef, error) -> KernelDef:
    for text, pos in _names(d):
        for key, at in _placeholders(text or "", pos):
            raise error(at, f"placeholder '{{{key}}}' has no binding (bind it with "
                        f"`for {key} in [...]` after the name)")
    return d


def _check_bindings(d: KernelDef, error) -> None:
    bound: dict[str, Binding] = {}
    for b in d.family:
        if b.key in bound:
            raise error(b.pos, f"'{b.key}' is bound twice in this family (first at "
                        f"{bound[b.key].pos})")
        bound[b.key] = b
        if not b.values:
            raise error(b.list_pos, f"'{b.key}' is bound to an empty list (a family needs "
                        "at least one value per binding)")
        listed: set[str | int] = set()
        for v in b.values:
            if v.value in listed:
                raise error(v.pos, f"'{v.value}' is listed twice for '{b.key}'")
            listed.add(v.value)
    for a in d.assigns:
        if a.key in bound:
            raise error(a.pos, f"'{a.key}' is bound by the family at {bound[a.key].pos} and "
                        "set in the body too")
    in_name = {key for key, _ in _placeholders(d.name, d.pos)}
    for b in d.family:
        if b.key not in in_name:
            raise error(b.pos, f"'{b.key}' is bound but '{{{b.key}}}' is not in the name "
                        f"'{d.name}' (its kernels would share one name)")


def _check_placeholders(d: KernelDef, lines: tuple[str, ...], error) -> None:
    bound = {b.key for b in d.family}
    places = [(text, pos, 0) for text, pos in _names(d) if text]
    places += [(a.value, a.value_pos, _quote(a.value_pos, lines)) for a in d.assigns
               if isinstance(a.value, str)]
    for text, pos, skip in places:
        for key, at in _placeholders(text, pos, skip):
            if key not in bound:
                raise error(at, f"placeholder '{{{key}}}' has no binding in this family "
                            f"(bound: {', '.join(b.key for b in d.family)})")


def _quote(pos: SourcePos, lines: tuple[str, ...]) -> int:
    """1 when the value at ``pos`` is a quoted string (its text starts after the quote)."""
    line = lines[pos.line - 1] if 0 < pos.line <= len(lines) else ""
    return int(line[pos.col - 1: pos.col] == '"')


def _expand_def(d: KernelDef, lines: tuple[str, ...], error) -> list[KernelDef]:
    _check_bindings(d, error)
    _check_placeholders(d, lines, error)
    made: dict[str, str] = {}
    out = []
    for combo in itertools.product(*(b.values for b in d.family)):
        values = {b.key: v for b, v in zip(d.family, combo, strict=True)}
        k = _instance(d, values)
        said = ", ".join(f"{key} = {v.value}" for key, v in values.items())
        if not k.name.isidentifier() or not k.name.isascii():
            raise error(d.pos, f"'{k.name}' ({said}) is not a valid kernel name")
        if k.name in made:
            raise error(d.pos, f"this family makes '{k.name}' twice ({made[k.name]}; "
                        f"{said})")
        made[k.name] = said
        out.append(k)
    return out


def _instance(d: KernelDef, values: dict[str, Bound]) -> KernelDef:
    """One combination: placeholders substituted, bindings as assignments."""

    def sub(text):
        if not isinstance(text, str):
            return text
        return PLACEHOLDER.sub(lambda m: str(values[m[1]].value), text)

    bound = tuple(Assign(b.key, values[b.key].value, b.pos, values[b.key].pos)
                  for b in d.family)
    return replace(
        d, name=sub(d.name), parent=sub(d.parent), family=(),
        assigns=bound + tuple(replace(a, value=sub(a.value)) for a in d.assigns),
        expects=tuple(replace(e, other=sub(e.other)) if isinstance(e, ExpectRelation) else e
                      for e in d.expects),
        drops=tuple(replace(x, target=sub(x.target)) for x in d.drops),
    )
