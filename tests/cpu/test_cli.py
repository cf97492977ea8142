"""The read-only commands: check (one file of a spec set), list, show."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kgen.cli import main
from kgen.compiler import pipeline

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"


def real_kernels() -> list:
    return pipeline.checked(pipeline.parse([SPECS], ROOT))


def check(capsys, *paths) -> tuple[int, str, str]:
    rc = main(["check", *map(str, paths)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_check_one_file_takes_its_parents_from_the_specs_beside_it(capsys):
    rc, out, _ = check(capsys, SPECS / "decode.kspec")
    assert rc == 0
    mine = sum(k.spec_path == "specs/decode.kspec" for k in real_kernels())
    assert f"{mine} kernels" in out
    assert re.search(r"\(definitions from \d+ other spec files?\)", out)


@pytest.mark.parametrize("spec", sorted(SPECS.glob("*.kspec")), ids=lambda p: p.name)
def test_each_real_spec_checks_alone(spec, capsys):
    rc, out, err = check(capsys, spec)
    assert rc == 0, err
    mine = sum(k.spec_path == f"specs/{spec.name}" for k in real_kernels())
    assert out.startswith(f"ok: 1 spec files, {mine} kernels")


def test_check_one_file_whose_parent_is_nowhere(tmp_path, capsys):
    f = tmp_path / "lone.kspec"
    f.write_text("kernel a : missing_base { module = m op = qz_split }\n")
    rc, _, err = check(capsys, f)
    assert rc == 2
    assert "inherits from unknown kernel 'missing_base'" in err and err.startswith(str(f))


# -- a spec set spread over files: one file checks as its directory does ------------------

BASE = "abstract kernel base {\n    op = flash\n}\n"
SET = {  # a module a file (a module's kernels are defined in one file)
    "a_base.kspec": BASE,
    # A relation target with its parent in a third file.
    "b_ref.kspec": "abstract kernel ref_base : base { module = m_ref mode = decode }\n"
                   "kernel ref_{kv} : ref_base for kv in [f32, q4] { }\n",
    "c_user.kspec": "kernel user : base {\n    module = m_user\n    mode = decode\n"
                    "    kv = q4\n    expect bit_exact with ref_q4\n}\n",
    "d_unrelated.kspec": "kernel other : base { module = m_other }\n",
}


@pytest.fixture
def spec_set(tmp_path):
    for name, text in SET.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def test_relation_targets_come_from_sibling_files_with_their_parents(spec_set, capsys):
    rc, out, err = check(capsys, spec_set / "c_user.kspec")
    assert (rc, err) == (0, "")
    # One set: the file is checked with every file beside it, as its directory is.
    assert out == f"ok: 1 spec files, 1 kernels (definitions from {len(SET) - 1} other spec " \
                  "files)\n"
    rc, out, _ = check(capsys, spec_set)
    assert rc == 0 and out.startswith("ok: 4 spec files, 4 kernels")


def test_a_broken_relation_target_fails_the_file_as_it_fails_the_directory(spec_set, capsys):
    ref = spec_set / "b_ref.kspec"
    ref.write_text(ref.read_text().replace("mode = decode", "mode = prefill"))
    rc_dir, _, err_dir = check(capsys, spec_set)
    rc_file, _, err_file = check(capsys, spec_set / "c_user.kspec")
    assert rc_dir == rc_file == 2
    assert "'user' and 'ref_q4' take different inputs" in err_file
    assert err_file == err_dir


@pytest.mark.parametrize("text", [
    "kernel other : base { op = nope }\n",  # a value of no key
    "kernel other : base { module = m_other\n",  # no parse
    "kernel other : base { module = m_other mode = decode mask = full }\n",  # a contract
])
def test_a_broken_sibling_fails_the_file_as_it_fails_the_directory(spec_set, capsys, text):
    """The file is checked against every file of its set, so a file beside that the
    directory refuses refuses it too, with the directory's error."""
    (spec_set / "d_unrelated.kspec").write_text(text)
    rc_file, out, err_file = check(capsys, spec_set / "c_user.kspec")
    rc_dir, _, err_dir = check(capsys, spec_set)
    assert (rc_file, out, rc_dir) == (2, "", 2)
    assert err_file.startswith(f"{spec_set}/d_unrelated.kspec:1:") and err_file == err_dir
    assert "Traceback" not in err_file


def test_fixtures_beside_each_other_are_no_set(capsys, monkeypatch):
    """tests/fixtures/invalid holds a mistake a file, with names defined in many of
    them: no set, so each file is checked with only what it needs from the others."""
    monkeypatch.chdir(ROOT)
    invalid = ROOT / "tests/fixtures/invalid"
    rc, _, err = check(capsys, "tests/fixtures/invalid/unknown_key.kspec")
    assert rc == 2 and err.startswith("tests/fixtures/invalid/unknown_key.kspec:")
    names = [d.name for f in pipeline.parse([invalid / n for n in ("unknown_key.kspec",
                                                                   "unknown_parent.kspec")])
             for d in f.kernels]
    assert len(names) != len(set(names))  # why the directory is no set


def test_every_file_of_a_valid_set_checks_alone(spec_set, capsys):
    for f in sorted(spec_set.glob("*.kspec")):
        rc, _, err = check(capsys, f)
        assert rc == 0, (f.name, err)


# -- one file of a set is refused what its directory refuses, at its own line ------------

def _refused(capsys, spec_dir: Path, name: str, text: str) -> tuple[str, str]:
    """``kgen check`` of a file ``name`` holding ``text`` in ``spec_dir``, and of the
    directory: both exit 2 with no traceback; the file's error (at its own line)."""
    f = spec_dir / name
    f.write_text(text, encoding="utf-8")
    rc_file, out, err_file = check(capsys, f)
    assert (rc_file, out) == (2, ""), err_file
    rc_dir, _, err_dir = check(capsys, spec_dir)
    assert rc_dir == 2, err_dir
    assert "Traceback" not in err_file + err_dir
    return err_file, err_dir


@pytest.fixture
def specs_copy(tmp_path):
    """The real spec set, in a directory of its own."""
    import shutil

    shutil.copytree(SPECS, tmp_path / "specs")
    return tmp_path / "specs"


def test_a_file_redefining_a_kernel_of_a_file_beside_it(specs_copy, capsys):
    err, _ = _refused(capsys, specs_copy, "zz_new.kspec",
                      "kernel fc_attn_kv_append {\n    module = zz_new\n    op = kv_append\n}\n")
    assert err.startswith(f"{specs_copy}/zz_new.kspec:1:8: error: kernel 'fc_attn_kv_append' "
                          f"is defined twice (first at {specs_copy}/append.kspec:11:8)\n")


def test_a_module_differing_only_in_case_from_one_beside_it(specs_copy, capsys):
    err, _ = _refused(capsys, specs_copy, "zz_new.kspec",
                      "kernel zz_split {\n    module = ATTN_UTIL\n    op = qz_split\n}\n")
    assert err.startswith(f"{specs_copy}/zz_new.kspec:2:5: error: module 'ATTN_UTIL' differs "
                          f"from module 'attn_util' ({specs_copy}/util.kspec:4:5) only in case")


@pytest.mark.parametrize("text, line, col", [
    ("kernel zz_split {\n    module = attn_util\n    op = qz_split\n}\n", 2, 5),
    # The module inherited from a parent in another file: the kernel's line.
    ("kernel zz_prefill : fc_attn_flash_prefill {\n    doc = \"a copy\"\n}\n", 1, 8),
])
def test_a_kernel_added_to_the_module_of_a_file_beside_it(specs_copy, capsys, text, line, col):
    err, err_dir = _refused(capsys, specs_copy, "zz_new.kspec", text)
    head = f"{specs_copy}/zz_new.kspec:{line}:{col}: error: module '"
    assert err.startswith(head) and "a module's kernels are defined in one spec file" in err
    assert err_dir.startswith(head)  # the directory says the same


def test_a_kernel_named_after_a_module_beside_it(specs_copy, capsys):
    err, _ = _refused(capsys, specs_copy, "zz_new.kspec",
                      "kernel attn_util {\n    module = zz_new\n    op = qz_split\n}\n")
    assert err.startswith(f"{specs_copy}/zz_new.kspec:1:8: error: kernel name 'attn_util' is "
                          "the name of module 'attn_util'")


@pytest.mark.parametrize("file, line, key, kernel", [
    ("decode.kspec", 18, "position = device", "fc_attn_flash_decode_dev"),  # engine.kspec's
    ("decode.kspec", 30, "position = device", "fc_attn_flash_decode_q4_dev"),
])
def test_a_deleted_line_that_breaks_a_relation_beside_it(specs_copy, capsys, file, line, key,
                                                          kernel):
    f = specs_copy / file
    lines = f.read_text(encoding="utf-8").split("\n")
    assert lines[line - 1].strip() == key
    text = "\n".join(lines[:line - 1] + lines[line:])
    err, err_dir = _refused(capsys, specs_copy, file, text)
    head, src, _ = err.split("\n", 2)
    at = next(i for i, ln in enumerate(text.split("\n"), 1) if f"kernel {kernel} " in ln)
    assert head.startswith(f"{f}:{at}:8: error: ") and f"kernel {kernel} " in src
    assert "take different inputs" in head and f"which is related to '{kernel}'" in head
    assert "engine.kspec" in head and "engine.kspec" in err_dir.split(":")[0]


def test_a_parents_choice_that_breaks_a_child_beside_it(spec_set, capsys):
    """The checked file's choice is refused at its line, naming the child beside it that
    it breaks; the directory's check says the child, with a note at that line."""
    base = spec_set / "a_base.kspec"
    text = BASE.replace("    op = flash\n", "    op = flash\n    ring_floor = batch\n")
    err, err_dir = _refused(capsys, spec_set, "a_base.kspec", text)
    line = text.split("\n").index("    ring_floor = batch") + 1
    ref = spec_set / "b_ref.kspec"
    assert err.startswith(f"{base}:{line}:5: error: ring_floor = batch needs a format with an "
                          f"fp16 window ring; kv = f32 has none (at {ref}:2:8, in 'ref_f32', "
                          "which inherits from 'base') [check_ring_floor]\n")
    assert err_dir.startswith(f"{ref}:2:8: error: ") and "(in kernel 'ref_f32')" in err_dir
    assert f"\n{base}:{line}:5: note: 'ref_f32' inherits ring_floor = batch from 'base'\n" \
        in err_dir


def test_a_deleted_format_that_breaks_a_relation_beside_it(spec_set, capsys):
    """``kv = q4`` deleted from the relation target's file (``kv = q8_0`` in the issue)."""
    ref = spec_set / "b_ref.kspec"
    user = spec_set / "c_user.kspec"
    ref.write_text("abstract kernel ref_base : base { module = m_ref mode = decode }\n"
                   "kernel ref_q4 : ref_base {\n    kv = q4\n}\n", encoding="utf-8")
    assert check(capsys, ref)[0] == 0
    err, err_dir = _refused(capsys, spec_set, "b_ref.kspec",
                            "abstract kernel ref_base : base { module = m_ref mode = decode }\n"
                            "kernel ref_q4 : ref_base {\n}\n")
    assert err.startswith(f"{ref}:2:8: error: 'user' and 'ref_q4' take different inputs")
    at = next(i for i, ln in enumerate(user.read_text().split("\n"), 1) if "expect" in ln)
    assert f"(at {user}:{at}:27, in 'user', which is related to 'ref_q4')" in err
    assert err_dir.startswith(f"{user}:{at}:27: error: 'user' and 'ref_q4' take different "
                              "inputs")


def test_a_file_beside_a_broken_one_is_refused_as_the_directory_is(specs_copy, capsys):
    (specs_copy / "zz_broken.kspec").write_text("kernel zz : fc_attn_flash_prefill { op = nope "
                                               "module = zz }\n", encoding="utf-8")
    rc, _, err = check(capsys, specs_copy / "util.kspec")
    rc_dir, _, err_dir = check(capsys, specs_copy)
    assert rc == rc_dir == 2
    assert err.startswith(f"{specs_copy}/zz_broken.kspec:1:") and err == err_dir


def _positions_paged(specs_copy: Path) -> Path:
    """specs/formats.kspec with its device-position kernels made paged ones."""
    f = specs_copy / "formats.kspec"
    text = f.read_text(encoding="utf-8")
    bound = "position in [host, device, slots]"
    assert bound in text
    f.write_text(text.replace(bound, "position in [host, paged, slots]"), encoding="utf-8")
    return f


def test_a_file_whose_change_breaks_a_relation_beside_it_is_refused_as_its_directory(
        specs_copy, capsys):
    """formats.kspec's device-position kernels renamed (made paged): kernels beside it
    still relate to them, so the file is refused with the directory's diagnostic."""
    gone = {k.name for k in real_kernels()
            if k.spec_path == "specs/formats.kspec" and k.position.value == "device"}
    relating = {r.other for k in real_kernels() if k.spec_path != "specs/formats.kspec"
                for r in k.relations} & gone
    assert relating  # kernels beside relate to what the change removes
    f = _positions_paged(specs_copy)
    rc_file, out, err_file = check(capsys, f)
    rc_dir, _, err_dir = check(capsys, specs_copy)
    assert (rc_file, out, rc_dir) == (2, "", 2)
    head = err_file.split("\n")[0]
    assert "is related to unknown kernel" in head and any(f"'{n}'" in head for n in relating)
    assert err_file == err_dir


def test_build_of_one_file_refuses_a_conflict_beside_it_before_compiling(specs_copy, capsys,
                                                                         monkeypatch, tmp_path):
    from kgen.toolchain import locate

    def no_toolchain():
        raise AssertionError("the toolchain was asked for")

    monkeypatch.setattr(locate, "find_toolchain", no_toolchain)
    monkeypatch.setattr(pipeline.Context, "locate_toolchain", staticmethod(no_toolchain))
    monkeypatch.setenv("KGEN_GENERATED", str(tmp_path / "generated"))
    f = specs_copy / "zz_new.kspec"
    f.write_text("kernel fc_attn_qz_split {\n    module = zz_new\n    op = qz_split\n}\n",
                 encoding="utf-8")
    rc, err = _run(capsys, "build", "-q", "--no-cache", str(f))
    assert rc == 2 and err.startswith(f"{f}:1:8: error: kernel 'fc_attn_qz_split' is defined "
                                      f"twice (first at {specs_copy}/util.kspec:3:8)")
    assert not (tmp_path / "generated").exists()
    f.unlink()
    rc, err = _run(capsys, "build", "-q", "--no-cache", str(_positions_paged(specs_copy)))
    rc_dir, _, err_dir = check(capsys, specs_copy)
    assert rc == rc_dir == 2 and err == err_dir and "is related to unknown kernel" in err
    assert not (tmp_path / "generated").exists()


# -- list and show ------------------------------------------------------------------------


def test_list_and_show(capsys):
    assert main(["list"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == len(real_kernels())
    assert any("fc_attn_flash_prefill_q4_kvs" in r for r in rows)
    assert main(["show", "fc_attn_flash_prefill_q4_kvs"]) == 0
    out = capsys.readouterr().out
    assert "fc_attn_flash_prefill_q4_kvs <- fc_attn_flash_prefill_q4_kr" in out
    assert "v_stage         = shared_q4" in out and "specs/prefill.kspec" in out
    assert "expect bit_exact with fc_attn_flash_prefill_q4" in out
    assert main(["show", "no_such_kernel"]) == 1


def test_list_filters(capsys):
    """A name pattern, --op, --kv and --head-dim keep exactly the kernels they name;
    --coverage adds each kernel's head_dims, the plain list has none."""
    from kgen.runtime.bind import shape_refusal

    every = real_kernels()
    cases = [
        (["list", "decode"], [k for k in every if "decode" in k.name]),
        (["list", "--op", "merge_attn_states,dense_attention"],
         [k for k in every if k.op.value in ("merge_attn_states", "dense_attention")]),
        (["list", "--kv", "q8_0", "--op", "flash"],
         [k for k in every if k.op.value == "flash" and "q8_0" in (k.kv.value, k.v_kv.value)]),
        (["list", "--head-dim", "96", "--op", "flash"],
         [k for k in every if k.op.value == "flash" and shape_refusal(k, 96, 1) is None]),
    ]
    for argv, want in cases:
        assert want, argv  # each filter keeps some kernels of the real specs
        assert main(argv) == 0
        rows = capsys.readouterr().out.splitlines()
        assert [r.split()[0] for r in rows] == [k.name for k in want], argv
        assert not any("head_dim" in r for r in rows)
    assert main(["list", "--coverage", "^fc_attn_kv_append$"]) == 0
    assert capsys.readouterr().out.split()[-2:] == ["head_dim", "1..1024"]


@pytest.mark.parametrize("argv, said", [
    (["list", "--op", "flsh"], "kgen list --op: unknown 'flsh' (did you mean 'flash'?)"),
    (["list", "--kv", "q5"], "kgen list --kv: unknown 'q5' (one of f32, "),
    (["list", "("], "kgen list: the pattern '(' is not a regular expression"),
    (["list", "--head-dim", "0"], "'0' is not a positive whole number"),
])
def test_list_refuses_unknown_filters(capsys, argv, said):
    rc, err = _run(capsys, *argv)
    assert rc == 2 and said in err


def test_check_reports_every_broken_file(tmp_path, capsys):
    """A directory with three broken files and a good one: each broken file is reported
    with its own first error, exit 2; the good one says nothing."""
    (tmp_path / "a_good.kspec").write_text(BASE + "kernel ok : base { module = m_ok }\n")
    (tmp_path / "b_parse.kspec").write_text("kernel x {\n  op = flash\n  garbage\n}\n")
    (tmp_path / "c_key.kspec").write_text("kernel y : base {\n  module = m_y\n"
                                          "  nosuchkey = 3\n}\n")
    (tmp_path / "d_value.kspec").write_text("kernel z : base {\n  module = m_z\n"
                                            "  kv = f33\n}\n")
    rc, out, err = check(capsys, tmp_path)
    assert rc == 2 and out == ""
    said = [line.split(": error: ")[0] for line in err.splitlines() if ": error: " in line]
    assert said == [f"{tmp_path}/b_parse.kspec:4:1", f"{tmp_path}/c_key.kspec:3:3",
                    f"{tmp_path}/d_value.kspec:3:8"]
    assert err.rstrip().endswith("kgen: 3 spec files do not check")
    assert main(["check", "--json", str(tmp_path)]) == 2
    import json

    got = json.loads(capsys.readouterr().out)
    assert got["error"] == got["errors"][0] and [e["path"] for e in got["errors"]] == [
        f"{tmp_path}/b_parse.kspec", f"{tmp_path}/c_key.kspec", f"{tmp_path}/d_value.kspec"]


def _run(capsys, *argv) -> tuple[int, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse refuses an argument with exit 2
        rc = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, err


@pytest.mark.parametrize("argv, said", [
    (["show", "fc_attn_flash_decode", "--arch", "sm_90"],
     "--arch picks the GPU of --sass's listing: give --sass too"),
    (["show", "fc_attn_flash_decode", "--sass", "--arch", "90"],
     "argument --arch: '90' is not a GPU architecture like sm_61 or sm_90"),
    (["show", "fc_attn_flash_decode", "--sass", "--arch", "sm_9x"],
     "argument --arch: 'sm_9x' is not a GPU architecture"),
])
def test_show_arch_is_refused_before_any_compile(capsys, argv, said):
    """kgen show --arch: only with --sass, and only a name like sm_61; refused with
    exit 2 before anything is compiled (no toolchain is needed to say so)."""
    rc, err = _run(capsys, *argv)
    assert rc == 2 and said in err


def test_a_mistyped_command_gets_the_closest_one(capsys):
    rc, err = _run(capsys, "buld", "specs/")
    assert rc == 2 and "unknown command 'buld' (did you mean 'build'?)" in err
    rc, err = _run(capsys, "xyzzy")
    assert rc == 2 and "unknown command 'xyzzy' (commands: build, verify" in err


@pytest.mark.parametrize("jobs", ["0", "-3", "100000", "many"])
def test_jobs_must_be_a_sensible_count(capsys, jobs):
    rc, err = _run(capsys, "check", "-j", jobs)
    assert rc == 2 and "argument -j/--jobs" in err


@pytest.mark.parametrize("argv, said", [
    (["--head-dim", "abc"], "argument --head-dim: 'abc' is not a positive whole number"),
    (["--groups", "0"], "argument --groups: '0' is not a positive whole number"),
    (["--contexts", ","], "argument --contexts: expected at least one value"),
    (["--kv", "nope"], "--kv nope: no such format"),
])
def test_tune_refuses_bad_arguments_before_looking_for_a_gpu(capsys, argv, said):
    rc, err = _run(capsys, "tune", *argv)
    assert rc == 2 and said in err


def test_tune_without_a_gpu_is_a_one_line_error(capsys, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_cupy(name, *a, **k):
        if name == "cupy":
            raise ImportError("No module named 'cupy'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    rc, err = _run(capsys, "tune")
    assert rc != 0 and err.startswith("kgen: error: kgen tune times kernels on a GPU")


def test_a_spec_file_named_twice_is_read_once(capsys):
    one = SPECS / "util.kspec"
    rc, out, err = check(capsys, one, SPECS / "." / "util.kspec", SPECS.parent / "specs" /
                         "util.kspec")
    assert rc == 0, err
    assert out.startswith("ok: 1 spec files, 1 kernels")
    rc, out, err = check(capsys, SPECS, one)  # a file and its directory
    assert rc == 0 and out.startswith(f"ok: {len(list(SPECS.glob('*.kspec')))} spec files"), err


def test_build_refuses_an_output_that_is_a_file(capsys, monkeypatch, tmp_path):
    out = tmp_path / "generated"
    out.write_text("mine\n")
    monkeypatch.setenv("KGEN_GENERATED", str(out))
    rc, err = _run(capsys, "build", "-q", str(SPECS / "util.kspec"))
    assert rc == 1 and "is not a directory; kgen build writes its output tree there" in err
    assert out.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "generated"]


@pytest.mark.parametrize("argv", [["show", "no_such_kernel"], ["freeze", "no_such_kernel"],
                                  ["verify", "--diff", "no_such_kernel"]])
def test_json_errors_are_json_on_stdout(capsys, argv):
    import json

    rc = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert rc == 1
    said = json.loads(out)["error"]
    assert "no_such_kernel" in said["message"] and said["exit_code"] == 1
    assert err.startswith("kgen: error: ")


@pytest.mark.parametrize("argv", [
    ["list", "--json", "--bogus"],            # an unknown flag
    ["build", "--json", "-j", "abc"],         # a bad value
    ["show", "--json"],                       # a missing argument
    ["buld", "--json"],                       # an unknown command
    ["list", "--json", "--head-dim", "0"],    # an argument type's refusal
    ["list", "--json", "--op", "flsh"],       # kgen's own usage error
    ["show", "--json", "no_such_kernel"],     # an unknown kernel
    ["check", "--json", "/nonexistent/x.kspec"],  # a spec error
])
def test_every_failing_json_call_prints_one_json_object(capsys, argv):
    """Under --json a refusal of any kind (argparse's included) is one JSON object on
    stdout, with an "error"; the words for a person still go to stderr."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc != 0 and err
    import json

    said = json.loads(out)
    assert set(said) >= {"error"} and said["error"]["message"]
