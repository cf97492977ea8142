"""Stage ``verify``: generated kernels against the golden, kernel by kernel.

A kernel is identical when (a) its normalised PTX entry equals the golden's,
(b) its SASS instruction stream (text and 64-bit encodings, control words
included) equals the golden's and (c) its ptxas resources equal the golden's.
A golden kernel that no module generates is *missing*, never skipped.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

from kgen.compiler.golden import Golden
from kgen.toolchain.cache import sha256
from kgen.toolchain.resources import Resources
from kgen.toolchain.sass_listing import Instr, encode


class Compiled:
    """One generated kernel after the toolchain stages.

    ``code`` is the kernel's encoded instruction stream (its cubin .text
    section); identity is decided on it. The SASS listing is only needed to
    show a difference, so it is produced on first use by ``load_sass``.
    """

    def __init__(self, name: str, module: str, ptx: str, sass: tuple[Instr, ...] | None = None,
                 resources: Resources | None = None, code: bytes | None = None,
                 load_sass: Callable[[], tuple[Instr, ...]] | None = None):
        self.name, self.module, self.ptx, self.resources = name, module, ptx, resources
        self._sass, self._code, self._load_sass = sass, code, load_sass

    @property
    def sass(self) -> tuple[Instr, ...]:
        if self._sass is None:
            self._sass = self._load_sass() if self._load_sass else ()
        return self._sass

    @property
    def code(self) -> bytes:
        if self._code is None:
            self._code = encode(self.sass)
        return self._code


@dataclass(frozen=True)
class Verdict:
    name: str
    status: str  # "identical", "different", "missing", "new"
    golden: str = ""  # what it was compared with: "reference", "frozen" or "" (nothing)
    ptx_equal: bool | None = None
    sass_equal: bool | None = None
    resources_equal: bool | None = None
    golden_regs: int | None = None
    regs: int | None = None
    module: str | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "identical"


def _mark(flag: bool | None) -> str:
    return "-" if flag is None else ("same" if flag else "DIFF")


def compare(golden: Golden, compiled: dict[str, Compiled], only: list[str] | None = None,
            context: int = 3) -> list[Verdict]:
    names = only or golden.kernels
    out = []
    for name in names:
        c = compiled.get(name)
        g_res = golden.resources.get(name)
        if name not in golden.ptx and name in golden.frozen:
            out.append(_compare_frozen(name, golden.frozen[name], c))
            continue
        if name not in golden.ptx:
            if c is None:
                out.append(Verdict(name, "missing", detail="neither golden nor generated"))
            else:
                out.append(Verdict(name, "new", regs=c.resources.registers, module=c.module,
                                   detail="no golden and no frozen snapshot: review it, then "
                                   "`kgen freeze`"))
            continue
        if c is None:
            out.append(Verdict(name, "missing", "reference",
                               golden_regs=g_res.registers if g_res else None,
                               detail="no spec generates this kernel"))
            continue
        ptx_eq = c.ptx == golden.ptx[name]
        sass_eq = c.code == encode(golden.sass.get(name, ()))
        res_eq = c.resources == g_res
        ok = ptx_eq and sass_eq and res_eq
        detail = ""
        if not ok:
            detail = first_difference(golden, c, context)
        out.append(Verdict(name, "identical" if ok else "different", "reference", ptx_eq,
                           sass_eq, res_eq,
                           g_res.registers if g_res else None, c.resources.registers, c.module,
                           detail))
    return out


def _compare_frozen(name: str, snap: dict, c: Compiled | None) -> Verdict:
    """A generated kernel against its ``kgen freeze`` snapshot: digests and resources."""
    regs = snap.get("resources", {}).get("registers")
    if c is None:
        return Verdict(name, "missing", "frozen", golden_regs=regs, module=snap.get("module"),
                       detail="frozen, but no spec generates it (drop it with `kgen freeze`)")
    have = c.resources.as_dict()
    ptx_eq = sha256(c.ptx.encode()) == snap.get("ptx_sha256")
    sass_eq = sha256(c.code) == snap.get("code_sha256")
    res_eq = have == snap.get("resources")
    ok = ptx_eq and sass_eq and res_eq
    parts = []
    if not res_eq:
        was = snap.get("resources", {})
        parts.append("resources: " + ", ".join(f"{k} {was.get(k)} -> {v}" for k, v in have.items()
                                                if was.get(k) != v))
    if not sass_eq:
        parts.append(f"SASS: the code ({len(c.code)} bytes) differs from the frozen snapshot "
                     f"({snap.get('code_bytes')} bytes)")
    elif not ptx_eq:
        parts.append("PTX entry differs from the frozen snapshot (SASS identical)")
    if parts:
        parts.append("an intended change? review it, then `kgen freeze " + name + "`")
    return Verdict(name, "identical" if ok else "different", "frozen", ptx_eq, sass_eq, res_eq,
                   regs, c.resources.registers, c.module, "\n".join(parts))


COLUMN = 58  # characters of each side of a SASS diff row
FIRST_DIFF_ROWS = 40  # rows of SASS diff the verify report shows per kernel


def _row(left: str, right: str, differ: bool) -> str:
    """One row of the side-by-side view; ``|`` marks rows whose words differ."""
    return f"  {left[:COLUMN]:<{COLUMN}} {'|' if differ else ' '} {right[:COLUMN]}".rstrip()


def sass_diff(golden: tuple[Instr, ...], generated: tuple[Instr, ...],
              context: int | None = 3, limit: int | None = None) -> list[str]:
    """Aligned golden | generated SASS; ``context=None`` gives the whole stream.

    Rows are aligned on the words (text and encoding), not on addresses, so an
    inserted instruction shifts the addresses after it without marking the
    rows that still match. ``limit`` caps the rows after the header.
    """
    ga = [_show(i) for i in golden]
    gb = [_show(i) for i in generated]
    sm = difflib.SequenceMatcher(a=[i.word for i in golden], b=[i.word for i in generated],
                                 autojunk=False)
    rows: list[str] = []
    groups = [sm.get_opcodes()] if context is None else list(sm.get_grouped_opcodes(context))
    more_regions = context is not None and len(groups) > 1
    if context is not None:
        groups = groups[:1]  # the first differing region
    for group in groups:
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                rows += [_row(x, y, False) for x, y in zip(ga[i1:i2], gb[j1:j2], strict=True)]
                continue
            n = max(i2 - i1, j2 - j1)
            left = ga[i1:i2] + [""] * (n - (i2 - i1))
            right = gb[j1:j2] + [""] * (n - (j2 - j1))
            rows += [_row(x, y, True) for x, y in zip(left, right, strict=True)]
    if limit is not None and len(rows) > limit:
        rows = rows[:limit] + [f"  ... {len(rows) - limit} more rows"]
    elif more_regions:
        rows.append("  ... more differences follow")
    return [_row("golden", "generated", True), *rows]


def _show(i: Instr) -> str:
    if i.addr is None:
        return f"  (ctrl {i.encoding})"
    return f"{i.addr:04x} {i.text}"


def ptx_diff(golden: str, generated: str, context: int | None = 3) -> list[str]:
    n = 10**9 if context is None else context
    lines = list(difflib.unified_diff(golden.splitlines(), generated.splitlines(),
                                      "golden", "generated", n=n, lineterm=""))
    return ["  " + ln for ln in (lines if context is None else lines[:40])]


def first_difference(golden: Golden, c: Compiled, context: int = 3) -> str:
    parts = []
    g_res = golden.resources.get(c.name)
    if g_res is None:
        parts.append("resources: the golden records none for this kernel")
    elif c.resources != g_res:
        diffs = [f"{k} {getattr(g_res, k)} -> {getattr(c.resources, k)}"
                 for k in c.resources.as_dict() if getattr(g_res, k) != getattr(c.resources, k)]
        parts.append("resources: " + ", ".join(diffs))
    g_sass = golden.sass.get(c.name, ())
    if c.code != encode(g_sass):
        parts.append(f"SASS ({len(g_sass)} golden words, {len(c.sass)} generated), "
                     f"first difference (`kgen verify --diff {c.name}` shows all):")
        parts += sass_diff(g_sass, c.sass, context, limit=FIRST_DIFF_ROWS)
    elif c.ptx != golden.ptx[c.name]:
        parts.append("PTX entry differs (SASS identical):")
        parts += ptx_diff(golden.ptx[c.name], c.ptx, context)
    return "\n".join(parts)


def table(verdicts: list[Verdict]) -> str:
    w = max([len(v.name) for v in verdicts] + [6])
    rows = [f"{'kernel':<{w}}  {'PTX':<4}  {'SASS':<4}  {'regs':<9}  verdict"]
    for v in verdicts:
        regs = "-"
        if v.golden_regs is not None or v.regs is not None:
            regs = f"{v.golden_regs if v.golden_regs is not None else '-'} -> " \
                   f"{v.regs if v.regs is not None else '-'}"
        kind = f" ({v.golden})" if v.golden == "frozen" else ""
        rows.append(f"{v.name:<{w}}  {_mark(v.ptx_equal):<4}  {_mark(v.sass_equal):<4}  "
                    f"{regs:<9}  {v.status}{kind}")
    return "\n".join(rows)


def summary(verdicts: list[Verdict]) -> str:
    counted = [v for v in verdicts if v.status != "new"]
    same = sum(v.ok for v in counted)
    parts = [f"{same}/{len(counted)} identical"]
    for status in ("different", "missing"):
        n = sum(v.status == status for v in counted)
        if n:
            parts.append(f"{n} {status}")
    new = sum(v.status == "new" for v in verdicts)
    if new:
        parts.append(f"{new} new (no golden: review, then `kgen freeze`)")
    frozen = sum(v.golden == "frozen" for v in counted)
    tail = f" ({len(counted) - frozen} reference, {frozen} frozen)" if frozen else ""
    return ", ".join(parts) + tail
