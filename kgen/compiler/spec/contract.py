"""What a semantic check sees and where its refusals point: the kernels checked and
their spec text (``Ctx``, whose ``error`` makes a check's SpecError), the spec set beside
them (``Beside``), and the helpers that name the assignment an error points at. The
op objects' check hooks (``kgen.ops``) use them; ``check`` runs the contracts.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from kgen.compiler.spec.ast import Assign, KernelDef, SpecFile
from kgen.errors import SourcePos, SpecError
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
        self.current: Kernel | None = None  # the kernel being checked now
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

    def error(self, pos: SourcePos, msg: str, culprit: Kernel | None = None) -> SpecError:
        """At ``pos``; but a kernel beside the checked files that one of their
        definitions breaks is reported at that definition (``culprit``, else the
        nearest of its ancestors there), naming where the broken line is."""
        k = self.current
        if (self.named is not None and k is not None and k.spec_path not in self.named
                and pos.path not in self.named):
            anchor = ((f"is related to '{culprit.name}'", culprit.pos)
                      if culprit is not None and culprit.spec_path in self.named
                      else self._anchor(k))
            if anchor is not None:
                msg += f" (at {pos}, in '{k.name}', which {anchor[0]})"
                pos = anchor[1]
        src = self.lines.get(pos.path, ())
        if self.contract:
            msg += f" [{self.contract}]"
        return SpecError(pos, msg, src[pos.line - 1] if 0 < pos.line <= len(src) else None)


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
    parent's in another file)."""
    spots = [k.where(key) for key in keys]
    own = [p for p in spots if p.path == k.pos.path and p.line >= k.pos.line]
    return max(own, key=lambda p: (p.line, p.col)) if own else spots[0]


def written_last(k: Kernel, *keys: str) -> str:
    """Of ``keys``, the one whose value the spec text sets last (where the error points)."""
    return max(keys, key=lambda n: (k.where(n).line, k.where(n).col))
