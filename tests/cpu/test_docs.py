"""The user docs (README.md, docs/*.md) against the repository and the code.

The README stays short and starts with the two set-up commands; every relative link lands
on a file (and a heading) inside this repository; the README's Python example is the torch
quick start's; docs/ops.md shows every public entry point with its signature as the code
has it, and every C++ op-level entry point; docs/spec-language.md names every spec key.
"""

from __future__ import annotations

import enum
import inspect
import re
from pathlib import Path

import pytest

import kgen
import kgen.runtime as runtime
from kgen.ir.axes import KEYS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 250

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def blocks(text: str, lang: str) -> list[str]:
    """The bodies of the fenced code blocks of ``lang``."""
    return re.findall(rf"^```{lang}[ \t]*\n(.*?)^```", text, re.S | re.M)


def prose(text: str) -> str:
    """``text`` without fenced code blocks or inline code (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped,
    spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(FENCE.sub("", page.read_text())):
        s = slug(title)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_the_docs_exist():
    for name in ("guide", "spec-language", "ops", "performance", "design"):
        assert (DOCS / f"{name}.md").is_file(), f"docs/{name}.md is missing"


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines, more than {README_MAX_LINES}: " \
        "move the detail into docs/"


def test_readme_starts_with_the_two_setup_commands():
    text = README.read_text()
    assert text.startswith("# kgen\n")  # also the wheel's long description (test_tc_wheel)
    first = FENCE.search(text)
    assert first is not None and first.group(0).startswith("```sh"), \
        "the README's first code block is the set-up commands (sh)"
    assert "\n## " not in text[: first.start()], "the set-up commands come before any section"
    commands = [line.split("#")[0].strip() for line in first.group(0).splitlines()[1:-1]]
    assert [c for c in commands if c][:2] == ["make build", "make test"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands_in_the_repository(page):
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}: link {target!r}"
        assert dest.is_relative_to(ROOT), f"{where} leaves the repository"
        assert dest.exists(), f"{where}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{where}: no heading #{anchor} in {dest.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_points_outside_the_repository(page):
    text = page.read_text()
    assert "../shared" not in text and "engine-ops.md" not in text and \
        "engine-attention.md" not in text, f"{page.name} names documents outside the repository"


def _code(text: str) -> list[str]:
    """Code lines, comments and imports left out."""
    out = []
    for line in text.splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith(("#", "import ", "from ")):
            out.append(line)
    return out


def test_the_readme_python_example_is_the_quick_start():
    (example, *_) = blocks(README.read_text(), "python")
    mine = _code(example)
    theirs = _code((ROOT / "examples" / "torch_quickstart.py").read_text())
    assert mine and any(theirs[i:i + len(mine)] == mine for i in range(len(theirs))), \
        "README.md's Python example must be examples/torch_quickstart.py's code " \
        "(tests/gpu/test_examples_gpu.py runs that file)"


def _kgen_has(name: str) -> bool:
    """kgen.<name> exists: a subpackage (found, not imported: kgen.torch needs torch) or
    a public call."""
    import importlib.util

    return importlib.util.find_spec(f"kgen.{name}") is not None or hasattr(kgen, name)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_name_only_kgen_exports(page):
    for block in blocks(page.read_text(), "python"):
        for name in re.findall(r"\bkgen\.([A-Za-z_]\w*)", block):
            assert _kgen_has(name), f"{page.name}: kgen.{name} does not exist"


def render(name: str, fn) -> str:
    """``name(params)`` as docs/ops.md writes a signature: no annotations, an enum
    default as its value."""
    parts, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.default is p.empty:
            parts.append(p.name)
        else:
            d = p.default.value if isinstance(p.default, enum.Enum) else p.default
            parts.append(f"{p.name}={d!r}")
    return f"{name}({', '.join(parts)})"


def signatures() -> list[str]:
    """Every public call's signature: the functions and classes of kgen.runtime.__all__,
    and the methods each class defines (a method taking ``who`` is an internal helper)."""
    out = []
    for name in runtime.__all__:
        obj = getattr(runtime, name)
        out.append(render(name, obj))
        if not inspect.isclass(obj) or issubclass(obj, BaseException):
            continue
        for attr, member in vars(obj).items():
            if attr.startswith("_") or not inspect.isfunction(member):
                continue
            if "who" in inspect.signature(member).parameters:
                continue
            out.append(render(f"{name}.{attr}", getattr(obj, attr)))
    return out


def test_ops_reference_has_every_signature():
    text = (DOCS / "ops.md").read_text()
    missing = [s for s in signatures() if s not in text]
    assert not missing, "docs/ops.md lacks (or has stale) signatures; the code has:\n" + \
        "\n".join(missing)


def test_ops_reference_lists_every_torch_op():
    """The PyTorch ops' table: one row per public call an op describes, with the arrays
    it writes and what it returns (kgen.ops.base.PublicCall; no torch needed)."""
    from kgen.ops import OPS

    text = (DOCS / "ops.md").read_text()
    rows = re.findall(r"^\| `torch\.ops\.kgen\.(\w+)` \|.*$", text, re.M)
    calls = [c for d in OPS.values() for c in d.public_calls]
    assert rows == [c.name for c in calls], "docs/ops.md's PyTorch ops table, in order"
    for c in calls:
        writes = ", ".join(f"`{n}`" for n in c.writes) or "nothing"
        returns = f"like `{c.result}`" if c.result else "nothing"
        row = f"| `torch.ops.kgen.{c.name}` | {writes} | {returns} |"
        assert row in text, f"docs/ops.md lacks (or has stale) {row}"


def test_ops_reference_has_every_cpp_entry_point():
    header = (ROOT / "templates" / "c" / "kgen_ops.hpp.j2").read_text()
    entries = re.findall(r"^Result (\w+)\(const (\w+) &\w+, CUstream \w+\);", header, re.M)
    assert entries
    text = (DOCS / "ops.md").read_text()
    missing = [f"{n}(const {t} &, CUstream)" for n, t in entries
               if f"`{n}(const {t} &, CUstream)`" not in text]
    assert not missing, "docs/ops.md lacks C++ entry points:\n" + "\n".join(missing)


def test_spec_language_names_every_key():
    text = (DOCS / "spec-language.md").read_text()
    missing = [k for k in KEYS if f"`{k}`" not in text]
    assert not missing, f"docs/spec-language.md's axis table lacks {missing}"
