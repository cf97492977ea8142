"""What a semantic check sees and where its refusals point: the kernels checked and
their spec text (``Ctx``, whose ``error`` makes a check's SpecError), the spec set beside
them (``Beside``), and the helpers that name the assignment an error points at. The
op objects' check hooks (``kgen.ops``) use them; ``check`` runs the contracts.

A check points at the choice it refuses (``k.where(key)``, ``blame``); where that choice
is inherited, ``Ctx.error`` moves the error to the most-derived kernel that made the
combination invalid: a kernel that sets ``kv = f32`` under a q4 parent's
``ring_floor = batch`` is refused at its own ``kv = f32``, naming it, with a note at the
parent's line. Every value of the IR carries where it was set and by which definition of
the kernel's lineage (``Kernel.origin``); which of a kernel's choices (``choices``) take
part is found by running the check again with each one undone: a choice whose undoing
makes the check pass is one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kgen.compiler.spec.ast import Assign, ExpectRelation, KernelDef, SpecFile
from kgen.errors import Note, SourcePos, SpecError
from kgen.ir.axes import KEYS
from kgen.ir.kernel import Kernel

Lines = dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class ModuleClaim:
    """A module as the first kernel of it that the checks met: its spelling, where
    that kernel set it, and the spec file of that kernel."""

    module: str
    pos: SourcePos
    path: str


def _module_assign(d: KernelDef, defs: Mapping[str, KernelDef]) -> Assign | None:
    """The ``module = ...`` a definition has, its own or its nearest ancestor's among
    ``defs`` (None where the chain leaves them, loops or sets none)."""
    seen: set[str] = set()
    while d is not None and d.name not in seen:
        seen.add(d.name)
        own = next((a for a in d.assigns if a.key == "module"), None)
        if own is not None:
            return own
        d = defs.get(d.parent) if d.parent else None
    return None


@dataclass(frozen=True)
class Beside:
    """The rest of a spec set, beside the files checked (``kgen check FILE``): what
    the rules that span a set's files need of it, read from the definitions alone
    (a file beside may be broken where FILE does not reach it): every definition's
    name, the concrete kernels' names (names of the kgen_kernels package) and each
    one's module."""

    names: Mapping[str, SourcePos] = field(default_factory=dict)
    kernels: frozenset[str] = frozenset()
    modules: Mapping[str, ModuleClaim] = field(default_factory=dict)  # lowercased

    @classmethod
    def of(cls, files: Sequence[SpecFile]) -> Beside:
        defs = {d.name: d for f in files for d in f.kernels}
        modules: dict[str, ModuleClaim] = {}
        for d in defs.values():
            a = None if d.abstract else _module_assign(d, defs)
            if a is not None and isinstance(a.value, str):
                modules.setdefault(a.value.lower(), ModuleClaim(a.value, a.pos, d.pos.path))
        return cls({n: d.pos for n, d in defs.items()},
                   frozenset(n for n, d in defs.items() if not d.abstract), modules)


@dataclass(frozen=True)
class Choice:
    """One choice a kernel's spec makes (a key's assignment, a budget, a relation): as
    written, where, the definition that makes it, how far up the lineage that is (0: the
    kernel's own) and the kernel without it (the value before it, else the default)."""

    said: str
    pos: SourcePos
    owner: str
    level: int
    without: Callable[[], Kernel] = field(compare=False)


def _value_said(key: str, value: object) -> str:
    value = getattr(value, "value", value)
    return f'"{value}"' if key == "doc" else str(value)


def _relation_said(r: ExpectRelation) -> str:
    if r.kind == "bit_exact":
        return f"expect bit_exact with {r.other}"
    return f"expect close_to {r.other} within {r.tolerance:g}"


def without_setting(k: Kernel, key: str) -> Kernel:
    """``k`` as it would resolve without its latest assignment of ``key``: the value
    that one overrides, else the key's default (V rows in K's format where nothing sets
    ``v_kv``)."""
    rest = k.settings(key)[:-1]
    value = rest[-1].value if rest else KEYS[key].default
    fields: dict[str, object] = {key: value}
    if key == "kv" and not k.settings("v_kv"):
        fields["v_kv"] = value
    if key == "v_kv" and value is None:
        fields["v_kv"] = k.kv
    origin = tuple((n, rest if n == key else c) for n, c in k.origin)
    return replace(k, origin=tuple((n, c) for n, c in origin if c), **fields)


def choices(k: Kernel) -> list[Choice]:
    """Every choice ``k``'s spec makes that decides something: each key's latest
    assignment, each budget and each relation, in that order."""
    level = {name: i for i, name in enumerate(k.lineage)}
    out = [Choice(f"{key} = {_value_said(key, chain[-1].value)}", chain[-1].pos,
                  chain[-1].owner, level.get(chain[-1].owner, 0),
                  lambda key=key: without_setting(k, key))
           for key, chain in k.origin]
    for b in k.budgets:
        out.append(Choice(f"'expect {b.resource} {b.op} {b.value}'", b.pos, b.owner,
                          level.get(b.owner, 0),
                          lambda b=b: replace(k, budgets=tuple(x for x in k.budgets
                                                               if x is not b))))
    for r in k.relations:
        out.append(Choice(f"'{_relation_said(r)}'", r.pos, r.owner, level.get(r.owner, 0),
                          lambda r=r: replace(k, relations=tuple(x for x in k.relations
                                                                 if x is not r))))
    return out


class _Trial(Exception):
    """A check's refusal while ``Ctx`` tries a kernel without one of its choices: only
    whether it comes matters."""


class Ctx:
    """What a check sees: the kernels checked, their spec text, the files named and the
    set beside them; ``error`` makes a check's SpecError (the op objects' hooks raise it)."""

    def __init__(self, kernels: list[Kernel], lines: Lines, named: Collection[str] | None,
                 named_defs: Mapping[str, SourcePos], beside: Beside):
        self.kernels = kernels
        self.by_name = {k.name: k for k in kernels}
        self.lines = lines
        self.named = None if named is None else frozenset(named)
        self.named_defs = named_defs
        self.beside = beside
        self.contract = ""  # the check_* running now; its name ends every message
        self.check: Callable[[Kernel, Ctx], None] | None = None  # and the check itself
        self.current: Kernel | None = None  # the kernel being checked now
        self._trying = False  # running the check on a kernel without one of its choices
        # Module name, lowercased -> the first kernel of it (the set beside first).
        self.modules: dict[str, ModuleClaim] = dict(beside.modules)

    def _anchor(self, k: Kernel) -> tuple[str, SourcePos] | None:
        """Why a kernel of a file beside the checked ones is checked (how it leans on
        one of their definitions), and that definition's position."""
        parent = next((n for n in k.lineage[1:] if n in self.named_defs), None)
        if parent is not None:
            return f"inherits from '{parent}'", self.named_defs[parent]
        other = next((r.other for r in k.relations if r.other in self.named_defs), None)
        if other is not None:
            return f"is related to '{other}'", self.named_defs[other]
        return None

    def _passes(self, k: Kernel) -> bool:
        """Whether the running check accepts ``k`` (a kernel without one of the checked
        kernel's choices); what the check records (modules claimed) is put back."""
        modules, current = dict(self.modules), self.current
        self._trying, self.current = True, k
        try:
            self.check(k, self)
            return True
        except Exception:  # its refusal (_Trial), or a kernel the check cannot read
            return False
        finally:
            self.modules, self.current, self._trying = modules, current, False

    def _parts(self, k: Kernel, pos: SourcePos) -> tuple[Choice | None, list[Choice]]:
        """The choice of ``k`` the refusal at ``pos`` points at (None: the kernel, or a
        default), and every choice that takes part in it: that one, and each whose undoing
        makes the running check pass."""
        made = choices(k)
        anchor = next((c for c in made if c.pos == pos), None)
        return anchor, [c for c in made if c is anchor or self._passes_without(c, k)]

    def _passes_without(self, c: Choice, k: Kernel) -> bool:
        try:
            other = c.without()
        except Exception:  # a value the kernel cannot do without
            return False
        return other != k and self._passes(other)

    def _note(self, msg: str, pos: SourcePos) -> Note:
        src = self.lines.get(pos.path, ())
        return Note(pos, msg, src[pos.line - 1] if 0 < pos.line <= len(src) else None)

    def error(self, pos: SourcePos, msg: str, culprit: Kernel | None = None) -> SpecError:
        """The refusal of the kernel being checked, which the check points at ``pos``.

        Where the kernel inherits the choice at ``pos``, the error moves to the
        most-derived choice in the kernel's file that takes part (``_parts``), else to the
        kernel itself (a choice of another file stays only where the kernel is in that
        file too), naming the kernel; each inherited choice that takes part gets a note at
        its line. A kernel beside the checked files (``kgen check FILE``) that one of
        their definitions breaks is reported there instead: at the choice of theirs that
        takes part, else at ``culprit`` or the nearest of its ancestors there, naming the
        kernel and the place it broke."""
        if self._trying:
            return _Trial(msg)
        k = self.current
        parts: list[Choice] = []
        named_it = False
        if k is not None and self.check is not None:
            anchor, parts = self._parts(k, pos)
            if anchor is not None and anchor.level > 0:
                below = sorted((c for c in parts if c.level < anchor.level
                                and c.pos.path == k.pos.path),
                               key=lambda c: (c.level, -c.pos.line, -c.pos.col))
                if below:
                    pos = below[0].pos
                elif anchor.pos.path != k.pos.path:
                    pos = k.pos
        if (self.named is not None and k is not None and k.spec_path not in self.named
                and pos.path not in self.named):
            theirs = sorted((c for c in parts if c.pos.path in self.named),
                            key=lambda c: (c.level, c.pos.line, c.pos.col))
            there = ((f"is related to '{culprit.name}'", culprit.pos)
                     if culprit is not None and culprit.spec_path in self.named
                     else (f"inherits from '{theirs[0].owner}'", theirs[0].pos) if theirs
                     else self._anchor(k))
            if there is not None:
                msg += f" (at {pos}, in '{k.name}', which {there[0]})"
                pos, named_it = there[1], True
        inherited = sorted((c for c in parts if c.level > 0 and c.pos != pos),
                           key=lambda c: (c.level, c.pos.line, c.pos.col))
        notes = [self._note(f"'{k.name}' inherits {c.said} from '{c.owner}'", c.pos)
                 for c in inherited]
        here = next((c for c in parts if c.level > 0 and c.pos == pos), None)
        if here is not None and not named_it:  # an inherited line: the kernel it fails in
            notes.insert(0, self._note(f"in kernel '{k.name}', which inherits {here.said} "
                                       f"from '{here.owner}'", k.pos))
        if (notes or here is not None) and not named_it and f"'{k.name}'" not in msg:
            msg += f" (in kernel '{k.name}')"
        src = self.lines.get(pos.path, ())
        if self.contract:
            msg += f" [{self.contract}]"
        return SpecError(pos, msg, src[pos.line - 1] if 0 < pos.line <= len(src) else None,
                         tuple(notes))


def kv_said(k: Kernel) -> str:
    """The kernel's cache formats as its spec says them: ``kv = q8_0``, or
    ``kv = q8_0, v_kv = q4`` for a mixed cache."""
    return f"kv = {k.kv.value}" + (f", v_kv = {k.v_kv.value}" if k.mixed else "")


def shadow_key(k: Kernel) -> str:
    """The key that brought fp16 shadows into the cache: kv, else v_kv."""
    return "kv" if k.fmt.shadows or not k.v_fmt.shadows else "v_kv"


def blame(k: Kernel, *keys: str):
    """Where a combination of ``keys`` was chosen: the assignment the kernel's own
    definition makes (the latest one), else the first key's, wherever it was set (an
    inherited combination that the kernel itself changed is the kernel's line, not the
    parent's; ``Ctx.error`` moves an inherited one to the kernel's)."""
    own = [chain[-1].pos for chain in map(k.settings, keys)
           if chain and chain[-1].owner == k.name]
    return max(own, key=lambda p: (p.line, p.col)) if own else k.where(keys[0])


def written_last(k: Kernel, *keys: str) -> str:
    """Of ``keys``, the one whose value the spec text sets last (where the error points)."""
    return max(keys, key=lambda n: (k.where(n).line, k.where(n).col))
