"""The widest access a kernel's CUDA source makes through each of its pointer parameters,
read off the generated source (no compiler): the evidence the alignment contracts
(``kgen.ir.signature.Param.align``) are checked against.

A pointer parameter is followed through the pointer locals its value flows into
(``const T *row = param + offset``, assignments to them) and the device helpers it is
passed to. An access through it is any pointer type it is seen as: its own element type,
a local's pointee, a ``reinterpret_cast<T *>(...)`` or C cast ``(T *)`` of an expression
pointing into it, a helper's pointer parameter. Values read through a pointer (a
subscript, a dereference, a call's result) carry no pointer on: an index read from a
table does not make the table's address part of the cache's. A cast of width W guarded
in the kernel by ``(reinterpret_cast<size_t>(p) & (W - 1)) == 0`` is the kernel's own
choice (it reads element by element otherwise) and asks nothing of the caller.

The reading is the templates' C subset: comments, declarations one a statement, no
macros that form pointers. It is a test's tool, not the compiler's.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass

# Bytes of the pointee types the templates emit.
SIZES = {"float4": 16, "uint4": 16, "int4": 16, "float2": 8, "uint2": 8, "int2": 8,
         "long long": 8, "unsigned long long": 8, "double": 8, "__half2": 4,
         "unsigned int": 4, "int": 4, "float": 4, "unsigned short": 2, "short": 2,
         "__half": 2, "unsigned char": 1, "signed char": 1, "char": 1}
_TYPE = (r"(?:const\s+)?(" + "|".join(re.escape(t) for t in sorted(SIZES, key=len,
                                                                    reverse=True))
         + r")\s*(?:const\s*)?\*")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_FUNC = re.compile(r"(__global__|__device__)[^;{}()]*?\b([A-Za-z_]\w*)\s*\(")
# A pointer declaration with an initializer: found at its "* name =", its type read back.
_DECL = re.compile(r"\*\s*([A-Za-z_]\w*)\s*=(?!=)\s*")
_DECL_TYPE = re.compile(r"(?:^|[^\w<])" + _TYPE + r"\s*$")
# An assignment to a plain name: found at its "=", the name read back.
_ASSIGN = re.compile(r"(?<![-+*/%&|^<>!=])=(?!=)\s*")
_ASSIGNED = re.compile(r"(?:^|[^\w.>*&\s])\s*([A-Za-z_]\w*)\s*$")
_CAST = re.compile(r"reinterpret_cast<\s*" + _TYPE + r"\s*>\s*\(|\(\s*" + _TYPE
                   + r"\s*\)\s*")
_GUARD = re.compile(r"\(\s*reinterpret_cast<size_t>\(\s*([A-Za-z_]\w*)\s*\)\s*&\s*(\d+)\s*\)"
                    r"\s*==\s*0")


def _strip_comments(s: str) -> str:
    """``s`` less its comments and launch bounds (blanked: offsets stay)."""
    s = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), s, flags=re.S)
    s = re.sub(r"//[^\n]*", lambda m: " " * len(m.group(0)), s)
    return re.sub(r"__launch_bounds__\([^)]*\)", lambda m: " " * len(m.group(0)), s)


_BRACKETS = {"(": re.compile(r"[()]"), "{": re.compile(r"[{}]")}


def _close(s: str, i: int, o: str = "(") -> int:
    """The offset of the bracket closing the ``o`` at ``i``."""
    depth = 0
    for m in _BRACKETS[o].finditer(s, i):
        depth += 1 if m.group(0) == o else -1
        if depth == 0:
            return m.start()
    raise ValueError(f"unbalanced {o} at {i}")


def _split(s: str) -> list[tuple[int, str]]:
    """Top-level comma-separated parts of ``s`` with their offsets."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append((start, s[start:i]))
            start = i + 1
    if s[start:].strip():
        out.append((start, s[start:]))
    return out


def _expression(s: str, i: int) -> str:
    """The expression at ``i``: up to a ``;`` or ``,`` at its depth, or the close of the
    group it sits in."""
    depth = 0
    for j in range(i, len(s)):
        ch = s[j]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return s[i:j]
            depth -= 1
        elif ch in ";," and depth == 0:
            return s[i:j]
    return s[i:]


@dataclass
class _Function:
    kind: str  # __global__ or __device__
    params: list[tuple[str, int | None]]  # (name, pointee bytes; None: not a pointer)
    body: str


def _functions(src: str) -> dict[str, _Function]:
    src = _strip_comments(src)
    out = {}
    for m in _FUNC.finditer(src):
        po = m.end() - 1
        pc = _close(src, po)
        if not src[pc + 1:].lstrip().startswith("{"):
            continue  # a declaration
        bo = src.index("{", pc)
        params = []
        for _, p in _split(src[po + 1:pc]):
            p = p.strip()
            t = re.fullmatch(_TYPE + r"\s*([A-Za-z_]\w*)", p)
            params.append((t.group(2), SIZES[t.group(1)]) if t else (p.split()[-1], None))
        out[m.group(2)] = _Function(m.group(1), params, src[bo:_close(src, bo, "{") + 1])
    return out


class _Scopes:
    """Which declaration an identifier at an offset of a body names (block scoping)."""

    def __init__(self, body: str, params: list[str]):
        self.at, self.inner, self.up = [-1], [0], {0: frozenset({0})}
        stack = [0]
        for m in _BRACKETS["{"].finditer(body):
            i, ch = m.start(), m.group(0)
            if ch == "{":
                n = len(self.up)
                self.up[n] = self.up[stack[-1]] | {n}  # the block and those around it
                stack.append(n)
            elif len(stack) > 1:
                stack.pop()
            else:
                continue
            self.at.append(i)
            self.inner.append(stack[-1])
        self.decls: dict[str, list[tuple[int, int]]] = {p: [(-1, 0)] for p in params}

    def block(self, at: int) -> int:
        """The innermost block around offset ``at``."""
        return self.inner[bisect_right(self.at, at) - 1]

    def declare(self, name: str, at: int) -> None:
        self.decls.setdefault(name, []).append((at, self.block(at)))

    def resolve(self, name: str, at: int):
        around = self.up[self.block(at)]
        best = None
        for pos, block in self.decls.get(name, ()):
            if pos < at and block in around:
                best = (name, pos)
        return best


def _pointers(e: str, at: int, scopes: _Scopes, src: dict) -> set[str]:
    """The parameters the value of expression ``e`` (at offset ``at``) may point into:
    its identifiers outside subscripts and call arguments, not dereferenced."""
    flat, stack, hidden = [], [], 0  # hidden: open subscripts and call argument lists
    for i, ch in enumerate(e):
        if ch in "([":
            inner = ch == "[" or bool(re.search(r"\w\s*$", e[:i]))
            flat.append(ch if not hidden else " ")
            stack.append(inner)
            hidden += inner
        elif ch in ")]":
            hidden -= stack.pop() if stack else 0
            flat.append(ch if not hidden else " ")
        else:
            flat.append(ch if not hidden else " ")
    flat = "".join(flat)
    out: set[str] = set()
    for m in _IDENT.finditer(flat):
        before, after = flat[:m.start()].rstrip(), flat[m.end():].lstrip()
        if after.startswith(("[", "(")) and not before.endswith("&"):
            continue  # a value read through it, or a call
        if re.search(r"(^|[=(,+\-?:])\s*\*$", before):
            continue  # a dereference
        d = scopes.resolve(m.group(0), at + m.start())
        out |= src.get(d, set())
    return out


def _widths(fn: _Function, helpers: dict[str, tuple[_Function, dict[str, int]]]
            ) -> dict[str, int]:
    """Bytes of the widest access through each pointer parameter of ``fn`` (``helpers``:
    the device functions it may call, with theirs)."""
    body = fn.body
    ptrs = {p: w for p, w in fn.params if w}
    scopes = _Scopes(body, list(ptrs))
    src: dict = {(p, -1): {p} for p in ptrs}
    decls = []
    for m in _DECL.finditer(body):
        t = _DECL_TYPE.search(body, max(0, m.start() - 40), m.start() + 1)  # to its "*"
        if t:
            scopes.declare(m.group(1), m.start(1))
            decls.append((m.group(1), m.start(1), SIZES[t.group(1)], m.end()))
    flows = [((name, pos), end) for name, pos, _, end in decls]
    for m in _ASSIGN.finditer(body):
        name = _ASSIGNED.search(body, max(0, m.start() - 60), m.start())
        if name is None:
            continue
        d = scopes.resolve(name.group(1), name.start(1))
        if d is not None and d[1] >= 0 and name.start(1) != d[1]:
            flows.append((d, m.end()))
    changed = True
    while changed:
        changed = False
        for d, end in flows:
            s = _pointers(_expression(body, end), end, scopes, src)
            if not s <= src.get(d, set()):
                src[d] = src.get(d, set()) | s
                changed = True
    guards = {m.group(1): int(m.group(2)) + 1 for m in _GUARD.finditer(body)}
    need = dict(ptrs)

    def access(params: set[str], width: int) -> None:
        for p in params:
            if width > guards.get(p, 0):
                need[p] = max(need[p], width)

    for name, pos, width, _ in decls:
        access(src.get((name, pos), set()), width)
    for m in _CAST.finditer(body):
        width = SIZES[m.group(1) or m.group(2)]
        if m.group(1):
            at = m.end()
        elif body.startswith("(", m.end()):
            at = m.end() + 1
        else:
            at = m.end()
            word = _IDENT.match(body, at)
            access(_pointers(word.group(0) if word else "", at, scopes, src), width)
            continue
        access(_pointers(_expression(body, at), at, scopes, src), width)
    calls = re.compile(r"\b(" + "|".join(map(re.escape, helpers))
                       + r")\s*(?:<[^;{}()]*?>)?\s*\(") if helpers else None
    for m in calls.finditer(body) if calls else ():
        helper, widths = helpers[m.group(1)]
        o = m.end() - 1
        args = _split(body[o + 1:_close(body, o)])
        for (pn, pw), (off, arg) in zip(helper.params, args, strict=False):
            if pw:
                access(_pointers(arg, o + 1 + off, scopes, src), widths[pn])
    return need


def pointer_accesses(source: str) -> dict[str, dict[str, int]]:
    """Each ``__global__`` kernel of a CUDA source: {pointer parameter: bytes of the
    widest access the source makes through it (at least its element's)}."""
    fns = _functions(source)
    helpers: dict[str, tuple[_Function, dict[str, int]]] = {}
    for name, fn in fns.items():  # a helper calls only the helpers above it
        if fn.kind == "__device__":
            helpers[name] = (fn, _widths(fn, helpers))
    return {name: _widths(fn, helpers) for name, fn in fns.items() if fn.kind == "__global__"}
