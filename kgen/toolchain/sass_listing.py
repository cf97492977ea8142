"""Parse ``cuobjdump -sass`` output into per-kernel instruction streams.

Kepler SASS interleaves a scheduling-control word before every seven
instructions; it is part of the encoding and so part of what must be
identical. Each item keeps the printed text and its 64-bit encoding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")
_CONTROL = re.compile(r"^\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")
# The second instruction of a dual-issue pair in an sm_5x/sm_6x listing (``{ A ; /* enc */``
# then ``B }``): its encoding stands alone on the next line. No sm_37 listing has one.
_PAIR_END = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*}\s*$")


def _text(printed: str) -> str:
    """An instruction's text, spaces collapsed, without a dual-issue pair's braces."""
    return " ".join(printed.removeprefix("{").removesuffix("}").split())


@dataclass(frozen=True)
class Instr:
    """One SASS word: an instruction (with its address) or a control word."""

    addr: int | None
    text: str
    encoding: str

    def render(self) -> str:
        if self.addr is None:
            return f"{'':8}{'':44} /* {self.encoding} */"
        return f"/*{self.addr:04x}*/ {self.text:<44} /* {self.encoding} */"

    @property
    def word(self) -> tuple[str, str]:
        """What identity compares: the text and the encoding, not the address."""
        return (self.text, self.encoding)


def parse(listing: str) -> dict[str, tuple[Instr, ...]]:
    """Map kernel name -> its instruction stream, in address order."""
    out: dict[str, list[Instr]] = {}
    current: list[Instr] | None = None
    pair_end: tuple[int, str] | None = None  # a pair's second instruction, its encoding next
    for line in listing.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current, pair_end = out.setdefault(m.group(1), []), None
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if m:
            current.append(Instr(int(m.group(1), 16), _text(m.group(2)), m.group(3)))
            continue
        m = _CONTROL.match(line)
        if m:
            if pair_end is not None:
                current.append(Instr(pair_end[0], pair_end[1], m.group(1)))
                pair_end = None
            else:
                current.append(Instr(None, "", m.group(1)))
            continue
        m = _PAIR_END.match(line)
        if m:
            pair_end = (int(m.group(1), 16), _text(m.group(2)) + " ;")  # as unpaired ones end
    return {k: tuple(v) for k, v in out.items()}


def render(stream: tuple[Instr, ...]) -> str:
    return "".join(i.render() + "\n" for i in stream)


def encode(stream: tuple[Instr, ...]) -> bytes:
    """The stream's 64-bit words as the cubin stores them (its .text section)."""
    return b"".join(int(i.encoding, 16).to_bytes(8, "little") for i in stream)


# -- the instruction mix of a kernel's loops (what bounds an issue-bound kernel, read
# -- from the SASS the target runs; no GPU) -------------------------------------------

_BRANCH = re.compile(r"\bBRA\b[^;]*?\b(0x[0-9a-f]+)\s*;")


def opcode(text: str) -> str:
    """An instruction's operation without its predicate and modifiers (FFMA, LDS, SHFL)."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].rstrip(";").split(".")[0] if words else ""


def loops(stream: tuple[Instr, ...]) -> list[tuple[int, int]]:
    """(first, last) addresses of each loop: a branch back to an address before its own
    (its target, the branch itself), in address order of the branch. A branch to itself
    (the padding after the last EXIT) is no loop, nor is a branch back from past the
    last unconditional EXIT: code there runs out of line and returns into the body (an
    sm_70+ ptxas's paths for a shuffle in a diverged warp)."""
    exits = [i.addr for i in stream if i.addr is not None and not i.text.startswith("@")
             and opcode(i.text) == "EXIT"]
    end = exits[-1] if exits else None
    out = []
    for i in stream:
        if i.addr is None or (end is not None and i.addr > end):
            continue
        m = _BRANCH.search(i.text)
        if m and int(m.group(1), 16) < i.addr:
            out.append((int(m.group(1), 16), i.addr))
    return out


def innermost(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The loops that hold no other loop."""
    return [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1]
                                        for o in spans)]


def mix(stream: tuple[Instr, ...], span: tuple[int, int] | None = None) -> dict[str, int]:
    """Instructions by opcode (control words not counted) in ``span`` (inclusive
    addresses), else in the whole stream; the most frequent first."""
    counts: dict[str, int] = {}
    for i in stream:
        if i.addr is None or (span and not span[0] <= i.addr <= span[1]):
            continue
        op = opcode(i.text)
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def profile(stream: tuple[Instr, ...]) -> list[dict]:
    """The kernel's mix, then each loop's (in loop order; innermost ones marked):
    {"what", "instructions", "ffma", "mix"} each."""
    spans = loops(stream)
    inner = set(innermost(spans))
    parts = [("kernel", None)] + [
        (f"loop {lo:#06x}-{hi:#06x}" + (" (innermost)" if (lo, hi) in inner else ""), (lo, hi))
        for lo, hi in spans]
    out = []
    for what, span in parts:
        m = mix(stream, span)
        out.append({"what": what, "instructions": sum(m.values()), "ffma": m.get("FFMA", 0),
                    "mix": m})
    return out
