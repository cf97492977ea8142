"""Stage ``parse``: spec text -> ``SpecFile`` (lark LALR, positions kept).

The transformer only builds frozen AST nodes; meaning is given later by
``resolve`` and the ``check_*`` functions.
"""

from __future__ import annotations

import difflib
from functools import cache
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from kgen.errors import SourcePos, SpecError
from kgen.spec.ast import Assign, ExpectRelation, ExpectResource, KernelDef, SpecFile

GRAMMAR = Path(__file__).with_name("kspec.lark")

# How the lexer's terminal names read in an error message.
_TERMINAL_WORDS = {
    "NAME": "a name", "INT": "an integer", "NUMBER": "a number", "STRING": "a string",
    "LBRACE": "'{'", "RBRACE": "'}'", "EQUAL": "'='", "COLON": "':'", "CMP": "'<=', '==' or '>='",
    "KERNEL": "'kernel'", "EXPECT": "'expect'", "ABSTRACT": "'abstract'", "WITH": "'with'",
    "WITHIN": "'within'", "BIT_EXACT": "'bit_exact'", "CLOSE_TO": "'close_to'",
    "$END": "end of file",
}


@cache
def _lark() -> Lark:
    return Lark(GRAMMAR.read_text(encoding="utf-8"), parser="lalr", propagate_positions=True,
                maybe_placeholders=False)


@v_args(inline=True)
class _Build(Transformer):
    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def _pos(self, tok: Token) -> SourcePos:
        return SourcePos(self.path, tok.line, tok.column)

    def word(self, tok):
        return (str(tok), self._pos(tok))

    def integer(self, tok):
        return (int(tok), self._pos(tok))

    def string(self, tok):
        return (str(tok)[1:-1], self._pos(tok))

    def assign(self, key, value):
        return Assign(str(key), value[0], self._pos(key), value[1])

    def expect_resource(self, name, cmp, value):
        return ExpectResource(str(name), str(cmp), int(value), self._pos(name))

    def expect_bit_exact(self, other):
        return ExpectRelation("bit_exact", str(other), 0.0, self._pos(other))

    def expect_close(self, other, tol):
        return ExpectRelation("close_to", str(other), float(tol), self._pos(other))

    def parent(self, name):
        return name

    @v_args(inline=False)
    def kernel_def(self, items):
        abstract = isinstance(items[0], Token) and items[0].type == "ABSTRACT"
        if abstract:
            items = items[1:]
        name, rest = items[0], items[1:]
        parent = None
        if rest and isinstance(rest[0], Token):
            parent, rest = rest[0], rest[1:]
        assigns = tuple(s for s in rest if isinstance(s, Assign))
        expects = tuple(s for s in rest if not isinstance(s, Assign))
        return KernelDef(
            str(name), str(parent) if parent else None, abstract, assigns, expects,
            self._pos(name), self._pos(parent) if parent else None,
        )

    @v_args(inline=False)
    def start(self, kernels):
        return tuple(kernels)


def _expected(exc: UnexpectedInput) -> str:
    names = sorted(getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ())
    words = sorted({_TERMINAL_WORDS.get(n, n.lower()) for n in names})
    return ", ".join(words)


def read_spec_text(path: Path) -> str:
    """The file's text, or a SpecError for missing, binary or non-UTF-8 files."""
    shown = str(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpecError(SourcePos(shown, 1, 1), "no such spec file") from None
    except IsADirectoryError:
        raise SpecError(SourcePos(shown, 1, 1), "is a directory, not a spec file") from None
    except OSError as exc:
        raise SpecError(SourcePos(shown, 1, 1), f"cannot read: {exc.strerror}") from None
    if b"\0" in data:
        raise SpecError(SourcePos(shown, 1, 1), "binary file (contains NUL bytes), not a spec")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError(SourcePos(shown, line, col), "not valid UTF-8") from None


def parse_spec(text: str, path: str = "<spec>") -> SpecFile:
    """Parse one spec file's text; raises SpecError at the first syntax error."""
    lines = tuple(text.splitlines())

    def err(line: int, col: int, msg: str) -> SpecError:
        src = lines[line - 1] if 0 < line <= len(lines) else None
        return SpecError(SourcePos(path, line, col), msg, src)

    if not text.strip() or all(
        not ln.strip() or ln.lstrip().startswith("#") for ln in lines
    ):
        raise err(1, 1, "empty spec file: expected at least one 'kernel' definition")
    try:
        tree = _lark().parse(text)
    except UnexpectedCharacters as exc:
        ch = text[exc.pos_in_stream] if exc.pos_in_stream < len(text) else "?"
        raise err(exc.line, exc.column, f"unexpected character {ch!r}") from None
    except UnexpectedToken as exc:
        tok = exc.token
        if tok.type == "$END":
            last = len(lines) or 1
            raise err(last, len(lines[-1]) + 1 if lines else 1,
                      f"unexpected end of file; expected {_expected(exc)}") from None
        msg = f"unexpected {str(tok)!r}; expected {_expected(exc)}"
        if tok.type == "NAME" and "KERNEL" in (exc.expected or ()):
            guess = difflib.get_close_matches(str(tok), ["kernel", "abstract"], n=1)
            if guess:
                msg += f" (did you mean '{guess[0]}'?)"
        raise err(tok.line, tok.column, msg) from None
    except UnexpectedEOF as exc:
        last = len(lines) or 1
        raise err(last, 1, f"unexpected end of file; expected {_expected(exc)}") from None
    kernels = _Build(path).transform(tree)
    return SpecFile(path, kernels, lines)


def parse_file(path: Path, shown: str | None = None) -> SpecFile:
    return parse_spec(read_spec_text(path), shown or str(path))
