"""The error kinds kgen reports to users (never as tracebacks)."""

from __future__ import annotations

import difflib
import shlex
import unicodedata
from dataclasses import dataclass


class KgenError(Exception):
    """A user-facing failure: printed as one message, exit status ``exit_code``."""

    exit_code = 1


@dataclass(frozen=True)
class SourcePos:
    """A place in a spec file, 1-based like compilers print it."""

    path: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Note:
    """A place an error leans on, shown after it (``path:line:col: note: msg``): e.g. the
    parent's line a kernel inherits a choice from."""

    pos: SourcePos
    message: str
    source_line: str | None = None


class SpecError(KgenError):
    """A spec that cannot be parsed or breaks a contract: ``path:line:col: error: msg``,
    then its notes, each ``path:line:col: note: msg``, as compilers print them."""

    exit_code = 2

    def __init__(self, pos: SourcePos, message: str, source_line: str | None = None,
                 notes: tuple[Note, ...] = ()):
        self.pos = pos
        self.message = message
        self.source_line = source_line
        self.notes = tuple(notes)
        super().__init__(self.render())

    def render(self) -> str:
        text = _diagnostic(self.pos, "error", self.message, self.source_line)
        return "\n".join([text, *(_diagnostic(n.pos, "note", n.message, n.source_line)
                                   for n in self.notes)])


def _diagnostic(pos: SourcePos, kind: str, message: str, source_line: str | None) -> str:
    message = "".join(_shown_char(c) for c in message)  # one line, whatever it quotes
    text = f"{pos}: {kind}: {message}"
    if source_line is not None:
        line, at = _shown_line(source_line, pos.col - 1)
        text += f"\n  {line}\n  {' ' * at}^"
    return text


def did_you_mean(word: str, known: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known``, or nothing."""
    guess = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f" (did you mean '{guess[0]}'?)" if guess else ""


# Longest source line shown under an error; longer ones show a window around the caret.
SHOWN_LINE_MAX = 120


def _shown_char(c: str) -> str:
    """One printable cell per character, so the caret stays under its column."""
    if c.isprintable():
        return c
    return " " if c == "\t" or unicodedata.category(c) == "Zs" else "?"


def _shown_line(source_line: str, at: int) -> tuple[str, int]:
    """The line as printed under an error, and the caret's offset in it."""
    line = "".join(_shown_char(c) for c in source_line.rstrip("\r\n"))
    at = max(at, 0)
    if len(line) <= SHOWN_LINE_MAX:
        return line, at
    start = min(max(at - SHOWN_LINE_MAX // 2, 0), max(len(line) - SHOWN_LINE_MAX, 0))
    end = start + SHOWN_LINE_MAX
    head = "..." if start > 0 else ""
    tail = "..." if end < len(line) else ""
    return head + line[start:end] + tail, at - start + len(head)


class UsageError(KgenError):
    """A command line that asks for something that does not exist (exit 2, as argparse)."""

    exit_code = 2


class ToolchainError(KgenError):
    """The CUDA 11.8 toolchain is missing or is not the version kgen pins."""

    exit_code = 3


class ToolError(KgenError):
    """A compiler tool failed; the message carries the command that reproduces it."""

    exit_code = 4

    def __init__(self, argv: list[str], env_path: str, returncode: int, output: str):
        self.argv = argv
        self.returncode = returncode
        self.output = output
        cmd = f"PATH={shlex.quote(env_path)} " + shlex.join(argv)
        super().__init__(
            f"{argv[0]} failed (exit {returncode}):\n{output.rstrip()}\n"
            f"reproduce with:\n  {cmd}"
        )


class VerifyError(KgenError):
    """Generated code is not identical to the golden."""

    exit_code = 1
