"""Stage ``parse``: spec text -> ``SpecFile`` (lark LALR, positions kept).

The transformer only builds frozen AST nodes; meaning is given later by
``resolve`` and the ``check_*`` functions.

Lines and columns are 1-based and count characters, lines split on ``\\n`` only
(as lark counts them), so ``SpecFile.lines[line - 1]`` is always the line an
error points into.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from functools import cache
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import (
    UnexpectedCharacters,
    UnexpectedEOF,
    UnexpectedInput,
    VisitError,
)

from kgen.compiler.spec.ast import (
    Assign,
    Binding,
    Bound,
    Drop,
    ExpectRelation,
    ExpectResource,
    KernelDef,
    SetDef,
    SetList,
    SetMinus,
    SetRef,
    SetWhere,
    SpecFile,
)
from kgen.errors import SourcePos, SpecError

GRAMMAR = Path(__file__).with_name("kspec.lark")

# How the lexer's terminal names read in an error message.
_TERMINAL_WORDS = {
    "NAME": "a name", "PATTERN": "a name", "INT": "an integer", "NUMBER": "a number",
    "STRING": "a string",
    "LBRACE": "'{'", "RBRACE": "'}'", "EQUAL": "'='", "COLON": "':'", "CMP": "'<=', '==' or '>='",
    "KERNEL": "'kernel'", "EXPECT": "'expect'", "ABSTRACT": "'abstract'", "WITH": "'with'",
    "WITHIN": "'within'", "BIT_EXACT": "'bit_exact'", "CLOSE_TO": "'close_to'",
    "DROP": "'drop'", "FOR": "'for'", "IN": "'in'", "LIST_OPEN": "'['", "RSQB": "']'",
    "COMMA": "','", "SET": "'set'", "WHERE": "'where'", "NOT": "'not'", "MINUS": "'-'",
    "$END": "end of file",
}

# Keyword terminals, for "did you mean" on a misspelled keyword.
_KEYWORDS = {
    "KERNEL": "kernel", "ABSTRACT": "abstract", "EXPECT": "expect", "WITH": "with",
    "WITHIN": "within", "BIT_EXACT": "bit_exact", "CLOSE_TO": "close_to", "DROP": "drop",
    "FOR": "for", "IN": "in", "SET": "set", "WHERE": "where", "NOT": "not",
}

# The keyword a word before an unexpected token may have been meant to be, by what the
# parser expected after that word: `expct registers` (an assignment's key, so '=') and
# `expect bitexact with` (a resource, so a comparison).
_KEYWORD_BEFORE = {
    frozenset({"EQUAL"}): ["expect", "drop"],
    frozenset({"CMP"}): ["bit_exact", "close_to"],
}

# Integers end up as C `int` constants.
INT_MAX = 2**31 - 1

_LAST_WORD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)[ \t\f\r]*\Z")


@cache
def _lark(cache_dir: Path | None = None) -> Lark:
    # The LALR tables are cached on disk under ``cache_dir`` (by default the
    # settings'; keyed by lark on the grammar's hash and the options), so a
    # process does not rebuild them.
    from kgen.config import Settings

    tables = Path(cache_dir or Settings.load().cache_dir) / "lark"
    cache_file = None
    try:
        tables.mkdir(parents=True, exist_ok=True)
        cache_file = str(tables / "kspec.lalr")
    except OSError:
        pass
    return Lark(GRAMMAR.read_text(encoding="utf-8"), parser="lalr", propagate_positions=True,
                maybe_placeholders=False, cache=cache_file or False)


def split_lines(text: str) -> tuple[str, ...]:
    """The source lines as the lexer counts them: split on ``\\n`` only."""
    return tuple(text.split("\n"))


@v_args(inline=True)
class _Build(Transformer):
    def __init__(self, path: str, lines: tuple[str, ...]):
        super().__init__()
        self.path = path
        self.lines = lines

    def _pos(self, tok: Token) -> SourcePos:
        return SourcePos(self.path, tok.line, tok.column)

    def _int(self, tok: Token) -> int:
        text = str(tok)
        digits = text.lstrip("-").lstrip("0")
        if len(digits) > 10 or abs(int(text)) > INT_MAX:
            raise SpecError(self._pos(tok), f"integer out of range (at most {INT_MAX} "
                            "either way: it becomes a C int)", self.lines[tok.line - 1])
        return int(text)

    def word(self, tok):
        return (str(tok), self._pos(tok))

    def integer(self, tok):
        return (self._int(tok), self._pos(tok))

    def string(self, tok):
        return (str(tok)[1:-1], self._pos(tok))

    def assign(self, key, value):
        return Assign(str(key), value[0], self._pos(key), value[1])

    def expect_resource(self, name, cmp, value):
        return ExpectResource(str(name), str(cmp), self._int(value), self._pos(name))

    def expect_bit_exact(self, other):
        return ExpectRelation("bit_exact", str(other), 0.0, self._pos(other))

    def expect_close(self, other, tol):
        return ExpectRelation("close_to", str(other), float(tol), self._pos(other))

    def drop_resource(self, name):
        return Drop("resource", str(name), self._pos(name))

    def drop_bit_exact(self, other):
        return Drop("bit_exact", str(other), self._pos(other))

    def drop_close(self, other):
        return Drop("close_to", str(other), self._pos(other))

    def parent(self, name):
        return name

    def binding(self, key, values):
        return Binding(str(key), values, self._pos(key))

    def set_list(self, list_open, *values):
        return SetList(tuple(Bound(v, pos) for v, pos in values), self._pos(list_open))

    def set_ref(self, name):
        return SetRef(str(name), self._pos(name))

    def set_minus(self, left, minus, right):
        return SetMinus(left, right, self._pos(minus))

    @v_args(inline=False)
    def set_where(self, items):
        base, where, *negated, flag = items
        return SetWhere(base, str(flag), bool(negated), self._pos(where), self._pos(flag))

    def set_def(self, name, expr):
        return SetDef(str(name), expr, self._pos(name))

    @v_args(inline=False)
    def family(self, bindings):
        return tuple(bindings)

    @v_args(inline=False)
    def kernel_def(self, items):
        abstract = isinstance(items[0], Token) and items[0].type == "ABSTRACT"
        if abstract:
            items = items[1:]
        name, rest = items[0], items[1:]
        parent = None
        if rest and isinstance(rest[0], Token):
            parent, rest = rest[0], rest[1:]
        family = ()
        if rest and isinstance(rest[0], tuple):
            family, rest = rest[0], rest[1:]
        return KernelDef(
            str(name), str(parent) if parent else None, abstract,
            tuple(s for s in rest if isinstance(s, Assign)),
            tuple(s for s in rest if isinstance(s, ExpectResource | ExpectRelation)),
            self._pos(name), self._pos(parent) if parent else None,
            drops=tuple(s for s in rest if isinstance(s, Drop)), family=family,
        )

    @v_args(inline=False)
    def start(self, items):
        return (tuple(d for d in items if isinstance(d, KernelDef)),
                tuple(d for d in items if isinstance(d, SetDef)))


def _acceptable(exc: UnexpectedInput) -> set[str]:
    """Terminal names the parser would have taken (``accepts`` also knows end of file)."""
    return set(getattr(exc, "accepts", None) or getattr(exc, "expected", None)
               or getattr(exc, "allowed", None) or ())


def _expected(exc: UnexpectedInput) -> str:
    words = sorted({_TERMINAL_WORDS.get(n, n.lower()) for n in _acceptable(exc)})
    return ", ".join(words)


def _line_col(data: bytes, at: int) -> tuple[int, int, str]:
    """1-based line and character column of byte ``at``, and that line (for display)."""
    start = data.rfind(b"\n", 0, at) + 1
    end = data.find(b"\n", at)
    line = data[start: end if end >= 0 else len(data)].decode("utf-8", errors="replace")
    col = len(data[start:at].decode("utf-8", errors="replace")) + 1
    return data.count(b"\n", 0, at) + 1, col, line


def read_spec_text(path: Path, shown: str | None = None) -> str:
    """The file's text, or a SpecError (naming the file ``shown``) for missing, binary
    or non-UTF-8 files. A UTF-8 byte-order mark is dropped (columns count after it)."""
    shown = shown or str(path)
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            raise SpecError(SourcePos(shown, 1, 1), "not a regular file (a FIFO, socket or "
                            "device): a spec is a text file")
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpecError(SourcePos(shown, 1, 1), "no such spec file") from None
    except IsADirectoryError:
        raise SpecError(SourcePos(shown, 1, 1), "is a directory, not a spec file") from None
    except OSError as exc:
        raise SpecError(SourcePos(shown, 1, 1), f"cannot read: {exc.strerror}") from None
    data = data.removeprefix(b"\xef\xbb\xbf")
    nul = data.find(b"\0")
    if nul >= 0:
        line, col, src = _line_col(data, nul)
        raise SpecError(SourcePos(shown, line, col),
                        "binary file (NUL byte): a spec is UTF-8 text", src)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, col, src = _line_col(data, exc.start)
        raise SpecError(SourcePos(shown, line, col),
                        f"not valid UTF-8 (byte 0x{data[exc.start]:02x}): a spec is UTF-8 text",
                        src) from None


def _syntax_error(exc: UnexpectedInput, text: str, lines: tuple[str, ...], err) -> SpecError:
    if isinstance(exc, UnexpectedCharacters):
        ch = text[exc.pos_in_stream] if exc.pos_in_stream < len(text) else ""
        if ch == '"':
            return err(exc.line, exc.column, "unterminated string (a string ends on its line)")
        return err(exc.line, exc.column, f"unexpected character {ch!r}")
    tok = getattr(exc, "token", None)
    if isinstance(exc, UnexpectedEOF) or tok is None or tok.type == "$END":
        if tok is not None and tok.end_line:  # lark's $END borrows the last token's place
            line, col = tok.end_line, tok.end_column
        else:
            last = max((i for i, ln in enumerate(lines) if ln.strip()), default=0)
            line, col = last + 1, len(lines[last].rstrip()) + 1
        return err(line, col, f"unexpected end of file; expected {_expected(exc)}")
    accepts = _acceptable(exc)
    msg = f"unexpected {str(tok)!r}; expected {_expected(exc)}"
    if tok.type == "NAME":
        keywords = sorted(_KEYWORDS[t] for t in accepts if t in _KEYWORDS)
        guess = difflib.get_close_matches(str(tok), keywords, n=1)
        if guess:
            return err(tok.line, tok.column,
                       f"'{tok}' is not a keyword (did you mean '{guess[0]}'?)")
    meant = _KEYWORD_BEFORE.get(frozenset(accepts))
    line_start = text.rfind("\n", 0, tok.start_pos) + 1
    before = _LAST_WORD.search(text, line_start, tok.start_pos) if meant else None
    if before:
        word = before.group(1)
        line, col = tok.line, before.start() - line_start + 1
        if word in ("kernel", "abstract") and accepts == {"EQUAL"}:
            return err(line, col, f"'{word}' inside a kernel's body (missing '}}' before it?)")
        guess = difflib.get_close_matches(word, meant, n=1)
        if guess and word != guess[0]:
            return err(line, col, f"'{word}' is not a keyword (did you mean '{guess[0]}'?)")
    return err(tok.line, tok.column, msg)


def parse_spec(text: str, path: str = "<spec>", cache_dir: Path | None = None) -> SpecFile:
    """Parse one spec file's text; raises SpecError at the first syntax error."""
    lines = split_lines(text)

    def err(line: int, col: int, msg: str) -> SpecError:
        src = lines[line - 1] if 0 < line <= len(lines) else None
        return SpecError(SourcePos(path, line, col), msg, src)

    if all(not ln.strip() or ln.lstrip().startswith("#") for ln in lines):
        empty = "empty spec file: expected at least one 'kernel' definition"
        if not text:  # no line to show
            raise SpecError(SourcePos(path, 1, 1), empty)
        raise err(1, 1, empty)
    try:
        tree = _lark(cache_dir).parse(text)
    except UnexpectedInput as exc:
        raise _syntax_error(exc, text, lines, err) from None
    try:
        kernels, sets = _Build(path, lines).transform(tree)
    except VisitError as exc:
        if isinstance(exc.orig_exc, SpecError):
            raise exc.orig_exc from None
        raise
    return SpecFile(path, kernels, lines, sets)


def parse_file(path: Path, shown: str | None = None, cache_dir: Path | None = None) -> SpecFile:
    return parse_spec(read_spec_text(path, shown), shown or str(path), cache_dir)
