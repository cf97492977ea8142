"""Property tests of the spec front end (parse, resolve, check) on hostile input.

Whatever the text, ``parse_spec`` + ``resolve`` + ``check`` either return kernels or raise
``SpecError`` with a position inside the text; any other exception is a bug.
"""

from __future__ import annotations

import contextlib
import re
from enum import Enum
from pathlib import Path

import hypothesis
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kgen.compiler.pipeline import checked, parse
from kgen.compiler.spec.parser import INT_MAX, parse_spec
from kgen.errors import SpecError
from kgen.ir.axes import KEYS, RESOURCES

ROOT = Path(__file__).resolve().parents[2]
SPEC_FILES = sorted((ROOT / "specs").glob("*.kspec"))
SPECS = {p.name: p.read_text(encoding="utf-8") for p in SPEC_FILES}
# One text holding every real kernel, so mutations reach resolve and check.
ALL_SPECS = "\n".join(SPECS[n] for n in sorted(SPECS))
PATH = "fuzz.kspec"

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

KEYWORDS = ("kernel", "abstract", "expect", "bit_exact", "close_to", "with", "within", "drop",
            "for", "in", "set", "where", "not")
ENUM_VALUES = sorted({m.value for k in KEYS.values()
                      if isinstance(k.type, type) and issubclass(k.type, Enum) for m in k.type})
PUNCT = ("{", "}", ":", "=", "<=", "==", ">=", "#", '"', "-", ".", "\n", "\t", "\r", " ", "[", "]",
         ",", "{kv}", "k_{kv}")


def front_end(text: str, path: str = PATH):
    """Run parse -> resolve -> check; return kernels, or the SpecError after validating it."""
    try:
        kernels = checked([parse_spec(text, path)])
    except SpecError as exc:
        assert_well_placed(exc, text, path)
        contract = re.search(r"\[(check_\w+)\]$", exc.message)
        event(f"rejected by {contract[1]}" if contract else "rejected by parse/resolve")
        return exc
    event("accepted")
    return kernels


def event(label: str) -> None:
    """Label the example for --hypothesis-show-statistics (only inside @given)."""
    with contextlib.suppress(Exception):
        hypothesis.event(label)


def assert_well_placed(exc: SpecError, text: str, path: str) -> None:
    lines = text.split("\n")  # as the lexer counts lines
    pos = exc.pos
    assert pos.path == path
    assert 1 <= pos.line <= len(lines) + 1, (pos, len(lines))
    assert pos.col >= 1, pos
    if pos.line <= len(lines):
        assert pos.col <= len(lines[pos.line - 1]) + 1, (pos, lines[pos.line - 1])
    rendered = exc.render()
    assert rendered.startswith(f"{path}:{pos.line}:{pos.col}: error: ")
    # The error, then each note (a place in the same text it leans on), each a heading
    # with the line and a caret under it where the line is known.
    shown = [(pos, exc.source_line)] + [(n.pos, n.source_line) for n in exc.notes]
    assert rendered.count("\n") == sum(2 if src is not None else 0 for _, src in shown) \
        + len(exc.notes)
    blocks = rendered.split("\n")
    for i, (at, src) in enumerate(shown):
        head = blocks.pop(0)
        assert head.startswith(f"{at}: {'error' if i == 0 else 'note'}: ")
        assert at.path == path and 1 <= at.line <= len(lines) and at.col >= 1, at
        if src is not None:
            assert src == lines[at.line - 1]
            blocks.pop(0)
            assert blocks.pop(0).strip() == "^"
    assert all(c == "\n" or c.isprintable() for c in rendered)


def test_real_specs_pass_the_front_end():
    """The base of the mutation tests is valid, so a no-op mutation must pass."""
    kernels = front_end(ALL_SPECS)
    assert isinstance(kernels, list)
    assert [k.name for k in kernels] == [k.name for k in checked(parse(SPEC_FILES))]


# --- (1) random text ---------------------------------------------------------------

@FAST
@given(st.text(max_size=400))
def test_random_text(text):
    front_end(text)


@FAST
@given(st.binary(max_size=400))
def test_random_bytes_decoded(data):
    front_end(data.decode("utf-8", errors="replace"))


SOUP_WORDS = st.sampled_from(
    (*KEYWORDS, *KEYS, *ENUM_VALUES, *RESOURCES, *PUNCT, "k", "base", "16", "-3", "0",
     "1e-3", "2", '"doc"', "# c\n", "kernal", "tile_kyes", "99999999999")
)


@FAST
@given(st.lists(SOUP_WORDS, max_size=60), st.sampled_from([" ", "\n", ""]))
def test_token_soup(words, sep):
    front_end(sep.join(words))


# --- (2) mutations of the real specs --------------------------------------------

TOKEN = re.compile(r'"[^"\n]*"|[A-Za-z_][A-Za-z0-9_]*|-?[0-9][0-9.eE+-]*|<=|==|>=|\s+|\S')


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


@st.composite
def mutated(draw):
    text = draw(st.sampled_from([ALL_SPECS, *SPECS.values()]))
    toks = tokens(text)
    assert "".join(toks) == text
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "insert", "replace",
                                   "truncate"]))
        if not toks:
            break
        i = draw(st.integers(0, len(toks) - 1))
        if op == "delete":
            del toks[i]
        elif op == "duplicate":
            toks.insert(i, toks[i])
        elif op == "swap":
            j = draw(st.integers(0, len(toks) - 1))
            toks[i], toks[j] = toks[j], toks[i]
        elif op == "insert":
            toks.insert(i, draw(st.text(min_size=1, max_size=3)))
        elif op == "replace":
            toks[i] = draw(st.one_of(SOUP_WORDS, st.sampled_from(toks)))
        else:
            toks = toks[:i]
    return "".join(toks)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated())
def test_mutated_specs(text):
    front_end(text)


# --- (3) well-formed kernel definitions from the grammar ------------------------
#
# Each example is "clean" (known keys, values of the key's type, known parents: it gets
# past resolve, into the check_* contracts) or "sloppy" (unknown keys and parents, values
# of any type, duplicate names, huge integers).

def _ident():
    return st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(
        lambda s: s not in KEYWORDS)


NAMES = st.sampled_from(["base", "k", "k0", "k1", "fc_attn"])
INTS = st.one_of(st.sampled_from([0, 1, 2, 3, 8, 12, 16, 17, 24, 32, 33, 64, 128, 1024]),
                 st.integers(-5, 300), st.integers(-2**40, 2**40))
VALUES = st.one_of(
    st.sampled_from(ENUM_VALUES), INTS, _ident(),
    st.text(st.characters(blacklist_characters='"\n', blacklist_categories=("Cs",)),
            max_size=12).map(lambda s: f'"{s}"'),
)
KEY_NAMES = st.one_of(st.sampled_from(sorted(KEYS)),
                      st.sampled_from(["tile_kyes", "modul", "foo", "ring"]), _ident())
SMALL_INTS = st.sampled_from([1, 2, 3, 4, 8, 12, 16, 16, 16, 17, 24, 32, 33, 64, 128, 256])


def typed_value(key: str):
    t = KEYS[key].type
    if isinstance(t, type) and issubclass(t, Enum):
        return st.sampled_from([m.value for m in t])
    if t is int:
        return SMALL_INTS
    return st.one_of(_ident(), st.sampled_from(['"attn x"', '"a */ b"', '"doc"']))


@st.composite
def statement(draw, index: int, clean: bool) -> tuple[str, tuple]:
    kind = draw(st.sampled_from(["assign"] * 5 + ["resource", "bit_exact", "close_to", "drop"]))
    if kind == "assign":
        if clean:
            key = draw(st.sampled_from(sorted(KEYS)))
            value = draw(typed_value(key))
        else:
            key, value = draw(KEY_NAMES), draw(VALUES)
        return f"{key} = {value}", ("assign", key, value)
    if kind == "resource":
        res = draw(st.sampled_from(RESOURCES) if clean else
                   st.one_of(st.sampled_from(RESOURCES), st.sampled_from(["regs", "spill"])))
        cmp, n = draw(st.sampled_from(["<=", "==", ">="])), draw(SMALL_INTS if clean else INTS)
        return f"expect {res} {cmp} {n}", ("resource", res, cmp, n)
    others = [f"k{j}" for j in range(index + 3) if j != index]
    other = draw(st.sampled_from(others) if clean else st.one_of(st.sampled_from(others), NAMES))
    if kind == "drop":
        what = draw(st.sampled_from(["resource", "bit_exact", "close_to"]))
        if what == "resource":
            res = draw(st.sampled_from(RESOURCES))
            return f"drop expect {res}", ("drop", "resource", res)
        said = "bit_exact with" if what == "bit_exact" else what
        return f"drop expect {said} {other}", ("drop", what, other)
    if kind == "bit_exact":
        return f"expect bit_exact with {other}", ("bit_exact", other)
    tol = draw(st.floats(0, 1.5 if clean else 10, allow_nan=False, allow_infinity=False))
    return f"expect close_to {other} within {tol!r}", ("close_to", other, tol)


def _stmt_key(stmt: tuple[str, tuple]) -> tuple:
    """What a kernel may say only once: a key, a budget, a relation."""
    t = stmt[1]
    return t[:3] if t[0] in ("resource", "drop") else t[:2]


@st.composite
def kernel_def(draw, index: int, clean: bool) -> tuple[str, tuple]:
    """Kernel ``k<index>``, a child of the prelude's ``base`` or of an earlier kernel."""
    abstract = draw(st.integers(0, 4)) == 0
    odd_name = st.one_of(NAMES, _ident())
    name = f"k{index}" if clean or draw(st.integers(0, 3)) else draw(odd_name)
    parents = [st.just("base")] * 2
    if index:
        parents.append(st.integers(0, index - 1).map(lambda j: f"k{j}"))
    if not clean:
        parents += [st.none(), odd_name]
    parent = draw(st.one_of(*parents))
    stmts = draw(st.lists(statement(index, clean), max_size=5 if clean else 7,
                          unique_by=_stmt_key if clean else None))
    family = draw(st.sampled_from([(), (), (), *FAMILIES]))
    if family:  # one kernel per value: k<index>_<value>, which later kernels cannot name
        name = f"{name}_" + "_".join(f"{{{key}}}" for key, _ in family)
    head = ("abstract " if abstract else "") + f"kernel {name}" + (f" : {parent}" if parent
                                                                   else "")
    if family:
        head += " for " + ", ".join(f"{key} in [{', '.join(map(str, vals))}]"
                                    for key, vals in family)
    sep = draw(st.sampled_from(["\n    ", " ", "\t"]))
    body = "".join(sep + s for s, _ in stmts)
    return f"{head} {{{body}\n}}\n", (abstract, name, parent, tuple(t for _, t in stmts),
                                      family)


FAMILIES = [(("kv", ("f32", "q4")),), (("max_groups", (4, 8)), ("position", ("host", "slots"))),
            (("kv", ()),), (("mode", ("prefill", "decode", "prefill")),)]


OPS = ["flash", "flash", "flash", "kv_append", "decode_combine", "qz_split"]


@st.composite
def generated_spec(draw, max_kernels: int = 5) -> tuple[str, list[tuple]]:
    clean = draw(st.booleans())
    prelude = ""
    if clean or draw(st.booleans()):
        op = draw(st.sampled_from(OPS))
        extra = draw(st.sampled_from(["", "    kv = q4\n", "    mode = decode\n"]))
        prelude = f"abstract kernel base {{\n    module = fuzz\n    op = {op}\n{extra}}}\n"
    n = draw(st.integers(1, max_kernels))
    defs = [draw(kernel_def(i, clean)) for i in range(n)]
    return prelude + "\n".join(t for t, _ in defs), [d for _, d in defs]


def _ints_in(defs) -> list[int]:
    out = []
    for _, _, _, stmts, _ in defs:
        for s in stmts:
            if s[0] == "assign" and isinstance(s[2], int):
                out.append(s[2])
            elif s[0] == "resource":
                out.append(s[3])
    return out


def _as_parsed(stmt: tuple):
    if stmt[0] == "assign":
        v = stmt[2]
        return ("assign", stmt[1], v[1:-1] if isinstance(v, str) and v.startswith('"') else v)
    return stmt


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(generated_spec())
def test_generated_kernels(spec):
    text, parsed = spec
    in_range = all(abs(n) <= INT_MAX for n in _ints_in(parsed))
    try:
        ast = parse_spec(text, PATH)
    except SpecError as exc:
        # Grammatical text fails to parse only on an integer a C int cannot hold.
        assert not in_range, exc.render()
        assert "integer out of range" in exc.message
        assert_well_placed(exc, text, PATH)
        return
    assert in_range
    # The parser reads back exactly what was written (the prelude's kernel first).
    got = ast.kernels[len(ast.kernels) - len(parsed):]
    for k, (abstract, name, parent, stmts, family) in zip(got, parsed, strict=True):
        assert (k.abstract, k.name, k.parent) == (abstract, name, parent)
        assert tuple((b.key, tuple(v.value for v in b.values.values)) for b in k.family) \
            == family
        back = [("assign", a.key, a.value) for a in k.assigns]
        back += [("resource", e.resource, e.op, e.value) if hasattr(e, "resource")
                 else (e.kind, e.other) if e.kind == "bit_exact"
                 else (e.kind, e.other, e.tolerance) for e in k.expects]
        back += [("drop", x.kind, x.target) for x in k.drops]
        want = [_as_parsed(s) for s in stmts if s[0] == "assign"]
        want += [s for s in stmts if s[0] not in ("assign", "drop")]
        want += [s for s in stmts if s[0] == "drop"]
        assert back == want
    front_end(text)


@FAST
@given(generated_spec(max_kernels=4), st.data())
def test_generated_kernels_mutated(spec, data):
    """Well-formed kernels with one character inserted or deleted anywhere."""
    text = spec[0]
    i = data.draw(st.integers(0, len(text)))
    if data.draw(st.booleans()) and i < len(text):
        text = text[:i] + text[i + 1:]
    else:
        text = text[:i] + data.draw(st.characters(blacklist_categories=("Cs",))) + text[i:]
    assume(text.strip())
    front_end(text)
