"""A new variant is a spec: a file of variants the reference lacks (its own
module, kernels of every format and staging, narrower tiles, cross-module
relations) builds with nothing else changed, keeps the reference kernels
identical, and its generated tests import and pass their host-only tiers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from tc_helpers import REPO

from kgen import pipeline
from kgen.golden import load_golden

EXTRA = REPO / "tests" / "fixtures" / "variants" / "extra.kspec"


@pytest.mark.toolchain
def test_a_spec_file_of_new_variants_builds_and_tests(ws, tmp_path):
    shutil.copy2(EXTRA, ws.specs / EXTRA.name)
    built = ws.kgen("build", str(ws.specs))
    assert built.rc == 0, built.text
    new = [k.name for k in pipeline.checked(pipeline.parse([EXTRA.parent]
                                                           + [REPO / "specs"]))
           if k.spec_path.endswith(EXTRA.name)]
    gen_tests = ws.root / "tests_generated_out"
    tests_dir = os.environ["KGEN_TESTS_GENERATED"]
    assert (ws.generated / "attn_extra.ptx").is_file()
    verified = ws.kgen("verify")
    assert verified.rc == 1, verified.text  # new kernels, not frozen: the gate fails
    assert all(f"{n} " in verified.out for n in new)
    verified = ws.kgen("verify", "--allow-new")
    assert verified.rc == 0, verified.text
    golden = [ln for ln in verified.out.splitlines() if ln.rstrip().endswith(" identical")]
    assert len(golden) == len(load_golden(REPO / "golden").kernels)
    assert all(f"{n} " in verified.out for n in new)
    # The generated tests of the new module, host tiers only (no GPU here).
    env = {**os.environ, "KGEN_GENERATED": str(ws.generated),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    shutil.copytree(tests_dir, gen_tests)
    shutil.copy2(REPO / "tests" / "conftest.py", gen_tests / "conftest.py")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-m", "not gpu", str(gen_tests / "test_attn_extra.py")],
                          cwd=ws.root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout
