"""Builds nothing can break: concurrent builds of one checkout, a build killed at every
point of the swap, builds of one spec file, builds from any directory, and the inputs
and settings that used to end in tracebacks or hangs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from tc_helpers import REPO

from kgen.compiler import pipeline
from kgen.compiler.atomic import JOURNAL_SUFFIX, read_tree

pytestmark = pytest.mark.toolchain

UTIL_DOC = 'doc = "split the joint q+gate projection into contiguous q and z"'


def scratch(parent: Path) -> list[str]:
    """Scratch trees and journals beside the outputs (the locks stay, like any lock)."""
    return sorted(p.name for p in parent.iterdir()
                  if p.name.startswith(".") and not p.name.endswith(".lock"))


@pytest.fixture
def tiny(ws):
    """The workspace with one spec (util.kspec: one small module), so a build takes a
    fraction of a second once its PTX is cached; two doc variants, A and B."""
    for p in ws.specs.glob("*.kspec"):
        if p.name != "util.kspec":
            p.unlink()
    spec = ws.specs / "util.kspec"
    text = spec.read_text(encoding="utf-8")
    assert UTIL_DOC in text
    variants = {v: text.replace(UTIL_DOC, f'doc = "variant {v}"') for v in "AB"}
    trees = {}
    for v, t in variants.items():  # each variant's expected trees (and a warm cache)
        spec.write_text(t, encoding="utf-8")
        r = ws.kgen("build", "-q")
        assert r.rc == 0, r.text
        trees[v] = ws.tree("generated")
    return ws, spec, variants, trees


def procs(ws, *argv_list, env=None):
    return [subprocess.Popen([sys.executable, "-m", "kgen", *argv], cwd=ws.root,
                             env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for argv in argv_list]


def results(ps):
    return [(p.wait(timeout=120), *p.communicate()) for p in ps]


def trees_now(ws):
    return ws.tree("generated")


def test_fifty_concurrent_build_pairs(tiny):
    """50 pairs of builds of one checkout, in waves of 10 pairs at once: each pair
    builds spec sets A (specs/) and B (a copy with another doc), so every build really
    writes. All succeed, and after each wave the tree is whole and of one variant."""
    ws, spec, variants, trees = tiny
    spec.write_text(variants["A"], encoding="utf-8")
    other = ws.root / "specs_b"
    other.mkdir()
    (other / spec.name).write_text(variants["B"], encoding="utf-8")
    for v, where in (("B", other), ("A", ws.specs)):  # trees of each set, as built alone
        assert ws.kgen("build", "-q", str(where)).rc == 0
        trees[v] = trees_now(ws)
    t0 = time.monotonic()
    for wave in range(5):
        ps = procs(ws, *[["build", "-q", str(where)] for _ in range(10)
                         for where in (ws.specs, other)])
        for rc, out, err in results(ps):
            assert rc == 0, f"wave {wave}: {out}{err}"
            assert "Traceback" not in err
        assert trees_now(ws) in (trees["A"], trees["B"]), f"wave {wave}: mixed trees"
        assert scratch(ws.generated.parent) == []
    assert time.monotonic() - t0 < 60
    # The stamp describes what is there: a rebuild of that set is a no-op.
    v = "A" if trees_now(ws) == trees["A"] else "B"
    where = ws.specs if v == "A" else other
    r = ws.kgen("build", str(where))
    assert r.rc == 0 and "up to date" in r.out, r.text
    assert trees_now(ws) == trees[v]


SWAP_POINTS = ["staged", "journal", "old-0", "new-0", "swapped"]


@pytest.mark.parametrize("point", SWAP_POINTS)
def test_a_build_killed_in_the_swap_is_finished_by_the_next(tiny, point):
    ws, spec, variants, trees = tiny
    spec.write_text(variants["A"], encoding="utf-8")
    assert ws.kgen("build", "-q").rc == 0
    spec.write_text(variants["B"], encoding="utf-8")
    ((rc, out, err),) = results(procs(ws, ["build", "-q"], env={"KGEN_FAULT_AT": point}))
    assert rc == 97, out + err  # ended where a kill would
    after = trees_now(ws)
    if point in ("staged",):
        assert after == trees["A"]  # nothing renamed: the old trees, whole
    # Whatever the crash left, the next build (or its recovery) makes the tree B.
    r = ws.kgen("build", "-q")
    assert r.rc == 0, r.text
    assert trees_now(ws) == trees["B"]
    assert scratch(ws.generated.parent) == []
    r = ws.kgen("build")
    assert r.rc == 0 and "up to date" in r.out, r.text


def test_a_journal_is_replayed_even_by_a_no_op_build(tiny):
    """Killed between the renames of the swap, with the stamp of the new inputs already
    recorded by an earlier build: the next build still finishes the swap first."""
    ws, spec, variants, trees = tiny
    spec.write_text(variants["B"], encoding="utf-8")
    assert ws.kgen("build", "-q").rc == 0  # B's stamp recorded
    spec.write_text(variants["A"], encoding="utf-8")
    assert ws.kgen("build", "-q").rc == 0
    spec.write_text(variants["B"], encoding="utf-8")
    ((rc, _, _),) = results(procs(ws, ["build", "-q"], env={"KGEN_FAULT_AT": "new-0"}))
    assert rc == 97
    assert (ws.generated.parent / f".{ws.generated.name}{JOURNAL_SUFFIX}").is_file()
    r = ws.kgen("build")
    assert r.rc == 0, r.text
    assert "finished an interrupted swap" in r.err
    assert trees_now(ws) == trees["B"]


def test_stale_scratch_and_tool_dirs_are_removed(tiny):
    ws, spec, variants, trees = tiny
    stale = [ws.generated.parent / f".{ws.generated.name}.new-dead1",
             ws.generated.parent / f".{ws.generated.name}.old-dead2"]
    for d in stale:
        (d / "sub").mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    tool = Path(tempfile.gettempdir()) / f"kgen-ptx-{dead}-zz"
    tool.mkdir()
    mine = Path(tempfile.gettempdir()) / f"kgen-ptx-{os.getpid()}-zz"
    mine.mkdir()
    r = ws.kgen("build")
    assert r.rc == 0, r.text
    assert not any(d.exists() for d in stale) and not tool.exists()
    assert mine.exists()  # a live process's work dir stays
    mine.rmdir()
    assert trees_now(ws) == trees["B"]


def test_build_one_file_writes_its_kernels_and_the_set_comes_back_from_the_store(ws):
    assert ws.kgen("build", "-q").rc == 0
    whole = ws.tree("generated")
    for name in ("prefill", "decode", "heads", "util"):
        spec = ws.specs / f"{name}.kspec"
        r = ws.kgen("build", "--json", str(spec))
        assert r.rc == 0, r.text
        built = json.loads(r.out)
        own = {k.name for k in pipeline.checked(pipeline.parse([ws.specs]))
               if Path(k.spec_path).name == spec.name}
        assert set(built["kernels"]) == own and built["compiled"] == [], name
        assert set(json.loads(ws.tree("generated")["manifest.json"])["kernels"]) == own
        c = ws.kgen("check", str(spec))
        assert c.rc == 0, c.text  # check FILE and build FILE agree
    r = ws.kgen("build", "--json")
    assert r.rc == 0 and json.loads(r.out)["compiled"] == [], r.text  # all from the store
    assert ws.tree("generated") == whole
    # A change in one kernel's spec compiles that kernel alone.
    ws.edit(ws.specs / "util.kspec", UTIL_DOC, 'doc = "changed"')
    r = ws.kgen("build", "--json")
    assert r.rc == 0 and json.loads(r.out)["compiled"] == ["fc_attn_qz_split"], r.text
    now = ws.tree("generated")
    changed = {n for n in set(now) | set(whole) if now.get(n) != whole.get(n)}
    # A doc is a comment: the source, the manifest, the C++ header (which quotes each
    # kernel's doc above its launch function) and the C++ source (which holds each
    # kernel's source hash, a tune store's staleness test) change; the fatbin is the
    # same bytes.
    assert changed == {"src/fc_attn_qz_split.cu", "manifest.json", "kgen_launch.hpp",
                       "kgen_launch.cpp"}, changed


def test_paths_from_the_project_root_wherever_kgen_runs(ws, monkeypatch):
    assert ws.kgen("build", "-q").rc == 0
    before = ws.tree("generated")
    sub = ws.root / "templates" / "kernels"
    monkeypatch.chdir(sub)
    r = ws.kgen("build")
    assert r.rc == 0 and "up to date" in r.out, r.text
    r = ws.kgen("build", "-q", os.path.relpath(ws.specs, sub))
    assert r.rc == 0, r.text
    assert ws.tree("generated") == before


def test_bad_inputs_and_settings_are_one_line_errors(ws, tmp_path, monkeypatch):
    loop = ws.specs / "loop.kspec"
    loop.symlink_to(loop)
    r = ws.kgen("check")
    assert r.rc == 2 and "loop.kspec:1:1: error: cannot read" in r.err, r.text
    loop.unlink()
    fifo = ws.specs / "x.kspec"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    for cmd in ("check", "build"):
        r = ws.kgen(cmd)
        assert r.rc == 2 and "x.kspec:1:1: error: not a regular file" in r.err, r.text
    assert time.monotonic() - t0 < 30
    fifo.unlink()
    bogus = tmp_path / "cache-file"
    bogus.write_text("")
    monkeypatch.setenv("KGEN_CACHE_DIR", str(bogus))
    r = ws.kgen("check")
    assert r.rc == 1 and "is not a directory" in r.err and "Traceback" not in r.err
    monkeypatch.undo()


def test_an_unwritable_output_directory_is_an_error(ws, tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"  # even root cannot make a directory under a file
    blocked.write_text("")
    monkeypatch.setenv("KGEN_GENERATED", str(blocked / "generated"))
    r = ws.kgen("build", "-q")
    assert r.rc == 1 and "a-file: " in r.err and "Traceback" not in r.err, r.text
    monkeypatch.undo()
    if os.geteuid() == 0:
        return  # root writes anywhere
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setenv("KGEN_GENERATED", str(ro / "generated"))
    ro.chmod(0o500)
    try:
        r = ws.kgen("build", "-q")
    finally:
        ro.chmod(0o700)
    assert r.rc == 1 and "Permission denied" in r.err and "Traceback" not in r.err


def test_an_nvcc_error_about_a_kernel_name_points_at_the_spec(ws):
    """A name the CUDA headers declare that the static list misses: nvcc's error is
    reported at the kernel's definition."""
    (ws.specs / "zz_name.kspec").write_text(
        "kernel erfcinvf : fc_attn_flash_decode_combine {\n    module = attn_name\n}\n",
        encoding="utf-8")
    r = ws.kgen("build", "-q")
    assert r.rc == 2, r.text
    first = r.err.splitlines()[0]
    assert first.startswith("specs/zz_name.kspec:1:8: error: kernel name 'erfcinvf' does not "
                            "compile as a CUDA symbol (nvcc: "), first


def test_cli_answers(ws):
    r = ws.kgen("show", "fc_attn_flash_prefil")
    assert r.rc == 1 and "did you mean 'fc_attn_flash_prefill'?" in r.err
    import json

    r = ws.kgen("show", "--json", "fc_attn_flash_prefill")
    assert json.loads(r.out)["keys"]["op"]["value"] == "flash"
    r = ws.kgen("check", "--json")
    assert json.loads(r.out)["ok"] is True
    r = ws.kgen("check", "--json", str(REPO / "tests/fixtures/invalid/unknown_key.kspec"))
    assert r.rc == 2 and json.loads(r.out)["error"]["line"] > 0
    r = subprocess.run([sys.executable, "-m", "kgen", "--help"], capture_output=True,
                       text=True, cwd=ws.root)
    assert "``" not in r.stdout
    assert shutil.which  # keep the import used


def test_show_sass_counts_the_kernels_own_stream(ws):
    """kgen show --sass: a reference kernel's instructions are its golden SASS's (the two
    are identical), its loops lie inside it, and its innermost loops hold FMAs."""
    import json

    from kgen.compiler.golden import _parse_rendered

    r = ws.kgen("show", "--sass", "--json", "-q", "fc_attn_flash_decode")
    assert r.rc == 0, r.text
    parts = json.loads(r.out)["parts"]
    golden = _parse_rendered((REPO / "golden/sass/fc_attn_flash_decode.sass").read_text())
    assert parts[0]["what"] == "kernel"
    assert parts[0]["instructions"] == sum(1 for i in golden if i.addr is not None)
    loops = parts[1:]
    assert loops and all(0 < p["instructions"] < parts[0]["instructions"] for p in loops)
    assert sum(p["ffma"] for p in loops if "innermost" in p["what"]) > 0


def test_show_sass_for_another_gpu_compiles_the_same_ptx_for_it(ws):
    """kgen show --sass --arch sm_61: the kernel's PTX compiled for a P40 as a driver's
    JIT would (this toolchain's ptxas): that target named, ptxas's resources for it, a
    stream other than the sm_37 one, its loops inside it with FMAs in the innermost;
    the sm_37 listing names its own resources as the build records them."""
    import json

    r = ws.kgen("show", "--sass", "--json", "-q", "fc_attn_flash_decode")
    assert r.rc == 0, r.text
    sm37 = json.loads(r.out)
    manifest = json.loads((ws.root / "generated" / "manifest.json").read_text())
    assert sm37["target"] == "sm_37"
    assert sm37["resources"]["registers"] == manifest["kernels"]["fc_attn_flash_decode"][
        "resources"]["registers"]
    r = ws.kgen("show", "--sass", "--json", "-q", "--arch", "sm_61", "fc_attn_flash_decode")
    assert r.rc == 0, r.text
    sm61 = json.loads(r.out)
    assert sm61["target"] == "sm_61" and sm61["resources"]["registers"] > 0
    parts = sm61["parts"]
    assert parts[0]["what"] == "kernel" and parts[0]["mix"] != sm37["parts"][0]["mix"]
    assert all(0 < p["instructions"] < parts[0]["instructions"] for p in parts[1:])
    assert sum(p["ffma"] for p in parts if "innermost" in p["what"]) > 0
    r = ws.kgen("show", "--sass", "-q", "--arch", "sm_99", "fc_attn_flash_decode")
    assert r.rc == 2 and "--arch sm_99: this toolchain's ptxas compiles the sm_37 PTX for " \
        "sm_37, " in r.text and "sm_61" in r.text and "Traceback" not in r.text


def test_a_symlinked_output_tree_is_written_where_it_points(tiny, monkeypatch):
    ws, spec, variants, trees = tiny
    spec.write_text(variants["A"], encoding="utf-8")
    elsewhere = ws.root / "elsewhere"
    elsewhere.mkdir()
    link = ws.root / "out_link"
    link.symlink_to(elsewhere)
    monkeypatch.setenv("KGEN_GENERATED", str(link))
    for _ in range(2):  # a build, then one that finds it up to date
        r = ws.kgen("build", "-q")
        assert r.rc == 0, r.text
    assert link.is_symlink() and link.resolve() == elsewhere.resolve()
    assert read_tree(elsewhere) == trees["A"]
    assert scratch(ws.root) == [] and scratch(elsewhere.parent) == []
