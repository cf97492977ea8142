"""Family expansion, the step before ``resolve``: a definition with a ``for`` clause
becomes one concrete definition per combination of its bindings.

    set pageable = formats where not shadows
    kernel fc_{kv}_{position} : base for kv in pageable, position in [host, device] { ... }

A binding takes a set (``_Sets``): a list, a built-in set (``kgen.ir.axes.SETS``:
``formats`` is every registered KV format, in registration order), a set the file
declares, ``a - b`` (a's values without b's, in a's order) or ``a where [not] flag``
(the registered objects of a that have, or lack, a yes/no property). A declared set
belongs to its file: its families may bind it, and a later declaration may use it.

Combinations are the cartesian product, first binding outermost. Each binding sets
its key as if assigned in the body (the binding's key is the origin of the value,
the value's own place is where a bad value is reported); ``{key}`` in the name, the
parent, relation and drop targets and string values is replaced by the value.
Whether a written-out value is valid for its key is resolve's question, asked per
kernel; whether a named set holds the key's values is asked here, at the binding
that chose it.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum

from kgen.compiler.spec.ast import (
    Assign,
    Binding,
    Bound,
    ExpectRelation,
    KernelDef,
    SetDef,
    SetExpr,
    SetList,
    SetMinus,
    SetRef,
    SetWhere,
    SpecFile,
)
from kgen.errors import SourcePos, SpecError, did_you_mean
from kgen.ir.axes import KEYS, SETS, BuiltinSet

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")

Error = Callable[[SourcePos, str], SpecError]


def expand(files: list[SpecFile]) -> list[SpecFile]:
    """Every file with its families expanded (files without one are returned as is)."""
    return [expand_file(f) for f in files]


def expand_file(f: SpecFile) -> SpecFile:
    """The file's kernels with families expanded; its declared sets are used up."""
    lines = f.lines

    def error(pos: SourcePos, msg: str) -> SpecError:
        return SpecError(pos, msg, lines[pos.line - 1] if 0 < pos.line <= len(lines) else None)

    if not any(d.family for d in f.kernels) and not _any_patterns(f) and not f.sets:
        return f  # the common case: nothing to expand or reject
    sets = _Sets(f.sets, error)  # every declaration checked, whether a family binds it
    out: list[KernelDef] = []
    for d in f.kernels:
        out += _expand_def(d, lines, sets, error) if d.family else [_no_family(d, error)]
    return replace(f, kernels=tuple(out), sets=())


# -- sets ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Set:
    """A set's value: its members in order, each where it was written (or named), and
    what it was made from."""

    said: str                      # as written (or its declared name), for messages
    members: tuple[Bound, ...]
    builtin: BuiltinSet | None = None  # made from a built-in set: the axis it holds
    declared: SetDef | None = None     # made from a declared set


def _start(e: SetExpr) -> SourcePos:
    """Where a set expression begins."""
    while isinstance(e, SetMinus | SetWhere):
        e = e.left if isinstance(e, SetMinus) else e.base
    return e.pos


def _said(e: SetExpr) -> str:
    if isinstance(e, SetList):
        return "[" + ", ".join(str(v.value) for v in e.values) + "]"
    if isinstance(e, SetRef):
        return e.name
    if isinstance(e, SetMinus):
        return f"{_said(e.left)} - {_said(e.right)}"
    return f"{_said(e.base)} where {'not ' if e.negated else ''}{e.flag}"


class _Sets:
    """The sets a file's bindings may name: the built-in ones and the file's own, every
    declaration made (and checked) in the order written, whether a family binds it."""

    def __init__(self, decls: tuple[SetDef, ...], error: Error):
        self.error = error
        self.decls: dict[str, SetDef] = {}  # name -> its first declaration
        for d in decls:
            self.decls.setdefault(d.name, d)
        self.values: dict[str, _Set] = {}  # the sets declared so far
        for d in decls:
            check_set_name(self, d)
            value = self.value(d.expr, f"in set '{d.name}'")
            check_set_not_empty(self, value, d.pos, f"set '{d.name}' = {value.said} holds no "
                                "value (a family binding it would make no kernel)")
            self.values[d.name] = replace(value, said=d.name, declared=d)

    def value(self, e: SetExpr, context: str) -> _Set:
        """The set ``e`` stands for; ``context`` says where it is written (for messages)."""
        if isinstance(e, SetList):
            check_set_list(self, e, context)
            return _Set(_said(e), e.values)
        if isinstance(e, SetRef):
            return check_set_ref(self, e)
        if isinstance(e, SetMinus):
            left, right = self.value(e.left, context), self.value(e.right, context)
            check_set_minus(self, e, left, right)
            out = {v.value for v in right.members}
            return replace(left, said=_said(e),
                           members=tuple(v for v in left.members if v.value not in out))
        base = self.value(e.base, context)
        check_set_where(self, e, base)
        have = [v for v in base.members
                if bool(getattr(base.builtin.members[v.value], e.flag)) != e.negated]
        return replace(base, said=_said(e), members=tuple(have))

    def bound(self, b: Binding) -> tuple[Bound, ...]:
        """The values ``b`` binds its key to, in order."""
        value = self.value(b.values, f"for '{b.key}'")
        if isinstance(b.values, SetList):
            check_set_not_empty(self, value, b.values.pos, f"'{b.key}' is bound to an empty "
                                "list (a family needs at least one value per binding)")
        else:
            check_set_not_empty(self, value, _start(b.values), f"'{b.key}' is bound to "
                                f"{value.said}, which holds no value (a family needs at "
                                "least one value per binding)")
        check_set_holds(self, b, value)
        return value.members


def _contract(fn):
    """A set rule names itself at the end of its messages, as the contracts of
    ``kgen/compiler/spec/check.py`` do."""

    @functools.wraps(fn)
    def run(*args):
        try:
            return fn(*args)
        except SpecError as exc:
            raise SpecError(exc.pos, f"{exc.message} [{fn.__name__}]", exc.source_line) from None

    return run


# The rules of sets, in the order a declaration or a binding meets them: a declared
# set's name, then its expression's (names, lists, '-', 'where', inside out), then its
# size; a binding's expression, its size, then whether it holds the key's values.


@_contract
def check_set_name(sets: _Sets, d: SetDef) -> None:
    """A declared set has a name of its own: not a built-in set's, declared once."""
    if d.name in SETS:
        raise sets.error(d.pos, f"'{d.name}' is a built-in set ({SETS[d.name].doc}): "
                         "declare a set of another name")
    first = sets.decls[d.name]
    if first is not d:
        raise sets.error(d.pos, f"set '{d.name}' is declared twice (first at {first.pos})")


@_contract
def check_set_ref(sets: _Sets, e: SetRef) -> _Set:
    """A set name is a built-in set or a set of this file; a declaration names only
    the sets declared above it (so no set is made of itself)."""
    if e.name in SETS:
        b = SETS[e.name]
        return _Set(e.name, tuple(Bound(v, e.pos) for v in b.members), builtin=b)
    if e.name in sets.values:
        return sets.values[e.name]
    d = sets.decls.get(e.name)
    if d is not None:  # only a declaration's expression gets here before it is made
        raise sets.error(e.pos, f"set '{e.name}' is declared at {d.pos}, not above this "
                         "declaration (a set is made of the sets declared before it)")
    raise sets.error(e.pos, f"unknown set '{e.name}': neither built in nor declared in this "
                     "file" + did_you_mean(e.name, sorted({*SETS, *sets.decls})))


@_contract
def check_set_list(sets: _Sets, e: SetList, context: str) -> None:
    """A list names each value once."""
    listed: set[str | int] = set()
    for v in e.values:
        if v.value in listed:
            raise sets.error(v.pos, f"'{v.value}' is listed twice {context}")
        listed.add(v.value)


@_contract
def check_set_minus(sets: _Sets, e: SetMinus, left: _Set, right: _Set) -> None:
    """``a - b`` takes out only values ``a`` holds (anything else is a misspelling, or a
    set that changed)."""
    have = {v.value for v in left.members}
    for v in right.members:
        if v.value not in have:
            at = v.pos if isinstance(e.right, SetList) else _start(e.right)
            raise sets.error(at, f"'{v.value}' is not in {left.said}: nothing to take out")


@_contract
def check_set_where(sets: _Sets, e: SetWhere, base: _Set) -> None:
    """``where`` tests a yes/no property of registered objects: its set is made from a
    built-in set, and the objects have that property."""
    if base.builtin is None:
        raise sets.error(e.pos, f"'where' tests registered objects' properties, and "
                         f"{base.said} holds only names (filter a built-in set such as "
                         f"{', '.join(SETS)})")
    flags = base.builtin.flags
    if e.flag not in flags:
        raise sets.error(e.flag_pos, f"'{e.flag}' is not a yes/no property of the members "
                         f"of '{_said(e.base)}'; expected one of " + ", ".join(flags)
                         + did_you_mean(e.flag, list(flags)))


@_contract
def check_set_not_empty(sets: _Sets, value: _Set, pos: SourcePos, msg: str) -> None:
    """A set holds at least one value (a family makes a kernel per value)."""
    if not value.members:
        raise sets.error(pos, msg)


@_contract
def check_set_holds(sets: _Sets, b: Binding, value: _Set) -> None:
    """A named set holds values of the key it binds, checked at the binding that chose
    it: a built-in set's axis is that key; a declared list's values are all values of
    it (a list written in the binding is resolve's to check, value by value)."""
    key = KEYS.get(b.key)
    if key is None:
        return  # resolve reports the unknown key at the binding
    at = _start(b.values)
    if value.builtin is not None:
        if value.builtin.key != b.key:
            raise sets.error(at, f"'{value.said}' holds values of '{value.builtin.key}' "
                             f"({value.builtin.doc}), not of '{b.key}'")
        return
    if value.declared is None:
        return
    for v in value.members:
        if not _holds(key.type, v.value):
            raise sets.error(at, f"set '{value.declared.name}' (declared at "
                             f"{value.declared.pos}) holds '{v.value}', which is not a "
                             f"value of '{b.key}'")


SET_CHECKS = (check_set_name, check_set_ref, check_set_list, check_set_minus, check_set_where,
              check_set_not_empty, check_set_holds)


def _holds(t: type, value: str | int) -> bool:
    """Whether ``value`` is of a key's type (an enum value, an integer, or a name)."""
    if isinstance(t, type) and issubclass(t, Enum):
        return value in {m.value for m in t}
    return isinstance(value, int) == (t is int)


# -- families -----------------------------------------------------------------------------


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


def _check_bindings(d: KernelDef, sets: _Sets, error) -> list[tuple[Bound, ...]]:
    """Each binding's values, in the order written. In this order: a key is bound once
    and its set is one it may bind (``_Sets.bound``, the check_set_* rules); no bound
    key is also set in the body; every bound key is in the name."""
    bound: dict[str, Binding] = {}
    values = []
    for b in d.family:
        if b.key in bound:
            raise error(b.pos, f"'{b.key}' is bound twice in this family (first at "
                        f"{bound[b.key].pos})")
        bound[b.key] = b
        values.append(sets.bound(b))
    for a in d.assigns:
        if a.key in bound:
            raise error(a.pos, f"'{a.key}' is bound by the family at {bound[a.key].pos} and "
                        "set in the body too")
    in_name = {key for key, _ in _placeholders(d.name, d.pos)}
    for b in d.family:
        if b.key not in in_name:
            raise error(b.pos, f"'{b.key}' is bound but '{{{b.key}}}' is not in the name "
                        f"'{d.name}' (its kernels would share one name)")
    return values


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


# The most kernels one family may make: far above any family a build holds (the whole
# spec set is under two thousand kernels) and low enough that a mistyped range is refused
# at once, at its ``for``, before any kernel is made (a million would take minutes).
FAMILY_MAX = 4096


def _expand_def(d: KernelDef, lines: tuple[str, ...], sets: _Sets,
                error) -> list[KernelDef]:
    values = _check_bindings(d, sets, error)
    size = math.prod(len(v) for v in values)
    if size > FAMILY_MAX:
        said = " x ".join(f"{len(v)} {b.key}" for b, v in zip(d.family, values, strict=True))
        raise error(d.family[0].pos, f"this family makes {size} kernels ({said}); a family "
                    f"makes at most {FAMILY_MAX}")
    _check_placeholders(d, lines, error)
    made: dict[str, str] = {}
    out = []
    for combo in itertools.product(*values):
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
