"""`kgen check` on invalid specs: compiler-style diagnostics, exit status 2, no traceback.

Every ``tests/fixtures/invalid/NAME.kspec`` holds one mistake; ``NAME.err`` next to it is
the exact stderr of ``kgen check tests/fixtures/invalid/NAME.kspec`` run from the project
root: ``path:line:col: error: message``, then the offending line and a caret under the
column; then each note (a place the error leans on, such as the line a choice is
inherited from) in the same form, ``path:line:col: note: message``. To add a case, write
the .kspec, run kgen check on it, read the output critically and save it as the .err.
Where the message lists every registered KV format, or every yes/no property of a format,
the .err says ``<every registered format>`` or ``<every format flag>`` instead, so a new
format or property changes no fixture.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kgen.cli import main
from kgen.compiler.pipeline import checked, parse
from kgen.compiler.spec.check import CHECKS
from kgen.compiler.spec.expand import SET_CHECKS
from kgen.compiler.spec.parser import parse_spec
from kgen.errors import SHOWN_LINE_MAX, SourcePos, SpecError
from kgen.formats import FORMATS, KvFormat

ROOT = Path(__file__).resolve().parents[2]
INVALID = Path("tests/fixtures/invalid")  # relative to ROOT: the paths errors print
FIXTURES = sorted((ROOT / INVALID).glob("*.kspec"))
HEAD = re.compile(r"^(?P<path>[^\n]+?):(?P<line>\d+):(?P<col>\d+): error: (?P<msg>.+)$")
NOTE = re.compile(r"^(?P<path>[^\n]+?):(?P<line>\d+):(?P<col>\d+): note: (?P<msg>.+)$")


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def kgen_check(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["check", *args])
    out, err = capsys.readouterr()
    return rc, out, err


# In a .err: the registry's names, and a format's yes/no properties, in their order.
EVERY = {"<every registered format>": ", ".join(FORMATS),
         "<every format flag>": ", ".join(KvFormat.flags())}


def expected_err(fixture: Path) -> str:
    text = fixture.with_suffix(".err").read_text(encoding="utf-8")
    for said, names in EVERY.items():
        text = text.replace(said, names)
    return text


def test_fixtures_are_paired():
    assert len(FIXTURES) >= 40
    errs = {p.stem for p in (ROOT / INVALID).glob("*.err")}
    assert errs == {p.stem for p in FIXTURES}


@pytest.mark.parametrize("fixture", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_invalid_spec_diagnostic(fixture: Path, capsys, at_root):
    rel = (INVALID / fixture.name).as_posix()
    rc, out, err = kgen_check(capsys, rel)
    assert rc == 2
    assert out == ""
    assert err == expected_err(fixture)


@pytest.mark.parametrize("fixture", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_expected_err_is_well_formed(fixture: Path):
    """The .err files themselves: one heading naming the fixture, the line, a caret."""
    lines = expected_err(fixture).split("\n")
    assert lines[-1] == ""  # print's newline
    lines = lines[:-1]
    head = HEAD.match(lines[0])
    assert head, lines[0]
    assert head["path"] == (INVALID / fixture.name).as_posix()
    line, col = int(head["line"]), int(head["col"])
    assert line >= 1 and col >= 1
    if fixture.stem == "text_empty":
        assert len(lines) == 1  # nothing to show under it
        return
    assert len(lines) % 3 == 0  # the error, then its notes: each a heading, a line, a caret
    for at in range(0, len(lines), 3):
        head = HEAD.match(lines[at]) if at == 0 else NOTE.match(lines[at])
        assert head, lines[at]
        line, col = int(head["line"]), int(head["col"])
        shown, caret = lines[at + 1], lines[at + 2]
        assert caret.strip() == "^" and caret.startswith("  ")
        source = (ROOT / head["path"]).read_bytes().split(b"\n")[line - 1]
        source = source.decode("utf-8", errors="replace")
        assert len(source) <= SHOWN_LINE_MAX
        source = source.rstrip("\r").replace("\t", " ")
        assert shown == "  " + "".join(c if c.isprintable() else "?" for c in source)
        assert caret.index("^") - 2 == col - 1


def test_every_contract_has_a_fixture():
    cited = {m for p in FIXTURES for m in re.findall(r"\[(check_\w+)\]", expected_err(p))}
    assert cited == {fn.__name__ for fn in (*CHECKS, *SET_CHECKS)}


def test_did_you_mean_fixtures():
    """Unknown keywords, keys, values, parents, kernels and resources all get a guess."""
    for stem, guess in [
        ("syntax_misspelled_kernel", "kernel"), ("syntax_misspelled_abstract", "abstract"),
        ("syntax_misspelled_expect", "expect"), ("syntax_misspelled_within", "within"),
        ("unknown_key", "tile_keys"), ("unknown_enum_value", "prefill"),
        ("unknown_parent", "base"), ("check_expectations_unknown_kernel", "fixture_prefill"),
        ("check_expectations_resource", "registers"), ("text_crlf", "decode"),
        ("syntax_misspelled_drop", "drop"), ("family_bad_value", "q4"),
        ("family_unknown_key", "kv"), ("set_unknown", "formats"),
        ("set_where_unknown_flag", "shadows"), ("syntax_misspelled_where", "where"),
    ]:
        first = expected_err(ROOT / INVALID / f"{stem}.kspec").split("\n")[0]
        first = re.sub(r" \[check_\w+\]$", "", first)
        assert first.endswith(f"(did you mean '{guess}'?)"), first


@pytest.mark.parametrize("stem", ["syntax_missing_brace", "check_shared_v_rounds",
                                  "text_binary"])
def test_subprocess_exit_code_and_no_traceback(stem: str):
    fixture = ROOT / INVALID / f"{stem}.kspec"
    proc = subprocess.run(
        [sys.executable, "-m", "kgen", "check", (INVALID / fixture.name).as_posix()],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == expected_err(fixture)


def test_debug_shows_traceback(capsys, at_root):
    fixture = ROOT / INVALID / "unknown_key.kspec"
    rc, out, err = kgen_check(capsys, "--debug", (INVALID / fixture.name).as_posix())
    assert rc == 2
    assert "Traceback (most recent call last)" in err
    assert "SpecError" in err
    assert err.endswith(expected_err(fixture))


def test_without_debug_no_traceback(capsys, at_root):
    rc, _, err = kgen_check(capsys, (INVALID / "unknown_key.kspec").as_posix())
    assert rc == 2
    assert "Traceback" not in err


def test_missing_file(capsys, at_root):
    rel = (INVALID / "no_such_spec.kspec").as_posix()
    assert not (ROOT / rel).exists()
    rc, out, err = kgen_check(capsys, rel)
    assert rc == 2
    assert err == f"{rel}:1:1: error: no such spec file\n"


def test_directory_without_specs(capsys, at_root, tmp_path):
    rc, _, err = kgen_check(capsys, str(tmp_path))
    assert rc == 2
    assert err == f"{tmp_path}:1:1: error: no *.kspec files here\n"


BASE = "abstract kernel base {\n    module = fixture\n    op = flash\n}\n"


def test_duplicate_kernel_across_files(capsys, at_root, tmp_path):
    (tmp_path / "a.kspec").write_text(BASE + "kernel k : base {\n}\n", encoding="utf-8")
    (tmp_path / "b.kspec").write_text("# second\nkernel k : base {\n}\n", encoding="utf-8")
    rc, _, err = kgen_check(capsys, str(tmp_path))
    assert rc == 2
    assert err == (f"{tmp_path}/b.kspec:2:8: error: kernel 'k' is defined twice "
                   f"(first at {tmp_path}/a.kspec:5:8)\n  kernel k : base {{\n         ^\n")


def test_parent_in_another_file(capsys, at_root, tmp_path):
    """Inheritance crosses files; an error in the parent's file points there."""
    (tmp_path / "a.kspec").write_text(BASE.replace("op = flash", "op = flsh"),
                                      encoding="utf-8")
    (tmp_path / "b.kspec").write_text("kernel k : base {\n}\n", encoding="utf-8")
    rc, _, err = kgen_check(capsys, str(tmp_path))
    assert rc == 2
    assert err.startswith(f"{tmp_path}/a.kspec:3:10: error: 'flsh' is not a value of 'op'")
    assert err.endswith("(did you mean 'flash'?)\n      op = flsh\n           ^\n")


def test_byte_order_mark_is_not_a_column(capsys, at_root, tmp_path):
    spec = BASE + "kernel k : base {\n    tile_kyes = 16\n}\n"
    (tmp_path / "bom.kspec").write_bytes(b"\xef\xbb\xbf" + spec.encode())
    rc, _, err = kgen_check(capsys, str(tmp_path / "bom.kspec"))
    assert rc == 2
    assert err.startswith(f"{tmp_path}/bom.kspec:6:5: error: unknown key 'tile_kyes'")


def test_huge_integer_is_a_spec_error():
    """A 5000-digit integer used to escape as lark's VisitError (int() digit limit)."""
    text = BASE + "kernel k : base {\n    tile_keys = " + "9" * 5000 + "\n}\n"
    with pytest.raises(SpecError) as info:
        parse_spec(text, "huge.kspec")
    assert info.value.pos == SourcePos("huge.kspec", 6, 17)
    assert "integer out of range" in info.value.message
    shown = info.value.render().split("\n")
    assert len(shown[1]) <= SHOWN_LINE_MAX + 2 + 6  # indent and the two "..."


def test_long_line_is_shown_around_the_caret():
    line = "x" * 300 + "@" + "y" * 300
    rendered = SpecError(SourcePos("f", 1, 301), "boom", line).render().split("\n")
    shown, caret = rendered[1][2:], rendered[2][2:]
    assert shown.startswith("...") and shown.endswith("...")
    assert shown[caret.index("^")] == "@"


def test_control_characters_do_not_break_the_caret():
    rendered = SpecError(SourcePos("f", 1, 4), "bad \x1b[31m", "\x0b\t a\r").render()
    assert rendered == "f:1:4: error: bad ?[31m\n  ?  a\n     ^"


def test_real_specs_pass(capsys, at_root):
    rc, out, err = kgen_check(capsys, "specs")
    n_files = len(list((ROOT / "specs").glob("*.kspec")))
    assert rc == 0, err
    assert err == ""
    m = re.fullmatch(r"ok: (\d+) spec files, (\d+) kernels\n", out)
    assert m and int(m[1]) == n_files
    assert int(m[2]) == len(checked(parse([ROOT / "specs"], ROOT)))


def test_real_specs_are_the_default(capsys, at_root):
    rc, out, _ = kgen_check(capsys)
    assert rc == 0
    assert out.startswith(f"ok: {len(list((ROOT / 'specs').glob('*.kspec')))} spec files")


@pytest.mark.parametrize("per_key", [17, 32])  # 83521 and 1048576 kernels
def test_a_family_too_large_is_refused_at_once_at_its_for(capsys, tmp_path, per_key):
    """A family past FAMILY_MAX kernels is refused at its first binding, naming each
    binding's count, before any kernel is made (in well under two seconds)."""
    import time

    from kgen.compiler.spec.expand import FAMILY_MAX

    values = ", ".join(str(v) for v in range(1, per_key + 1))
    f = tmp_path / "big.kspec"
    f.write_text(f"set dims = [{values}]\n\n"
                 "kernel big_{tile_keys}_{dot_lanes}_{max_groups}_{k_pad} for tile_keys in "
                 "dims, dot_lanes in dims, max_groups in dims, k_pad in dims {\n"
                 "    module = m_big\n    op = flash\n}\n", encoding="utf-8")
    t0 = time.perf_counter()
    rc, _, err = kgen_check(capsys, str(f))
    assert time.perf_counter() - t0 < 2
    n = per_key ** 4
    assert n > FAMILY_MAX and rc == 2
    col = 1 + f.read_text().splitlines()[2].index("tile_keys in")
    assert err.startswith(
        f"{f}:3:{col}: error: this family makes {n} kernels ({per_key} tile_keys x {per_key} "
        f"dot_lanes x {per_key} max_groups x {per_key} k_pad); a family makes at most "
        f"{FAMILY_MAX}")
