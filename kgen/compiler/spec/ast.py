"""Frozen dataclasses the parser builds; one node per spec construct.

Positions (``pos``) are excluded from equality, so two specs that say the same
thing compare equal wherever they were written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kgen.errors import SourcePos


@dataclass(frozen=True)
class Assign:
    key: str
    value: str | int
    pos: SourcePos = field(compare=False)
    value_pos: SourcePos = field(compare=False)


@dataclass(frozen=True)
class ExpectResource:
    """``expect registers <= 72``: a budget ptxas's report must meet. ``owner`` is the
    kernel whose body set it (filled in by resolve), so an inherited budget that fails
    can say where it came from."""

    resource: str
    op: str
    value: int
    pos: SourcePos = field(compare=False)
    owner: str = field(compare=False, default="")


@dataclass(frozen=True)
class ExpectRelation:
    """``expect bit_exact with K`` / ``expect close_to K within 1e-3``. ``owner``: the
    kernel whose body set it (filled in by resolve)."""

    kind: str
    other: str
    tolerance: float
    pos: SourcePos = field(compare=False)
    owner: str = field(compare=False, default="")


@dataclass(frozen=True)
class Drop:
    """``drop expect registers`` (every inherited budget on that resource),
    ``drop expect bit_exact with K``, ``drop expect close_to K``."""

    kind: str  # "resource", "bit_exact" or "close_to"
    target: str  # the resource, or the related kernel
    pos: SourcePos = field(compare=False)


@dataclass(frozen=True)
class Bound:
    """One value of a family binding (a name or an integer)."""

    value: str | int
    pos: SourcePos = field(compare=False)


@dataclass(frozen=True)
class SetList:
    """``[f32, q4]``: the values written out, in order."""

    values: tuple[Bound, ...]
    pos: SourcePos = field(compare=False)  # the '['


@dataclass(frozen=True)
class SetRef:
    """``formats``: a built-in set, or one the file declares with ``set``."""

    name: str
    pos: SourcePos = field(compare=False)


@dataclass(frozen=True)
class SetMinus:
    """``formats - [q4]``: the left set without the right one's values, in the left's
    order."""

    left: SetExpr
    right: SetExpr
    pos: SourcePos = field(compare=False)  # the '-'


@dataclass(frozen=True)
class SetWhere:
    """``formats where not shadows``: the members whose yes/no property ``flag`` is
    true (false with ``not``), in the set's order."""

    base: SetExpr
    flag: str
    negated: bool
    pos: SourcePos = field(compare=False)  # the 'where'
    flag_pos: SourcePos = field(compare=False)


SetExpr = SetList | SetRef | SetMinus | SetWhere


@dataclass(frozen=True)
class SetDef:
    """``set pageable = formats where not shadows``: a set its file's families may bind."""

    name: str
    expr: SetExpr
    pos: SourcePos = field(compare=False)


@dataclass(frozen=True)
class Binding:
    """``kv in [f32, q4]`` or ``kv in formats`` in a family's ``for`` clause."""

    key: str
    values: SetExpr
    pos: SourcePos = field(compare=False)


@dataclass(frozen=True)
class KernelDef:
    name: str
    parent: str | None
    abstract: bool
    assigns: tuple[Assign, ...]
    expects: tuple[ExpectResource | ExpectRelation, ...]
    pos: SourcePos = field(compare=False)
    parent_pos: SourcePos | None = field(compare=False, default=None)
    drops: tuple[Drop, ...] = ()
    family: tuple[Binding, ...] = ()  # empty: one kernel; else expanded before resolve


@dataclass(frozen=True)
class SpecFile:
    path: str
    kernels: tuple[KernelDef, ...]
    lines: tuple[str, ...] = field(compare=False, repr=False, default=())
    sets: tuple[SetDef, ...] = ()  # declared sets; none once the file is expanded
