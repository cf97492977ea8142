"""A new variant is a spec: files of variants the specs lack (modules of their own,
kernels of every format and staging, narrower tiles, cross-module relations,
and a file written afterwards with mixes nobody planned: paged + register K +
options, fp16 q and K over fp8, multi-row with 8-key tiles) build with nothing
else changed, keep every existing kernel identical, and their generated tests
import and pass their host-only tiers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from tc_helpers import REPO

from kgen.compiler import pipeline
from kgen.compiler.golden import load_golden

VARIANTS = REPO / "tests" / "fixtures" / "variants"
FILES = sorted(VARIANTS.glob("*.kspec"))  # extra (planned), unplanned and warp_stream variants


@pytest.mark.toolchain
def test_a_spec_file_of_new_variants_builds_and_tests(ws, tmp_path):
    for f in FILES:
        assert not (ws.specs / f.name).exists(), f"{f.name} would replace a spec file"
        shutil.copy2(f, ws.specs / f.name)
    built = ws.kgen("build", str(ws.specs))
    assert built.rc == 0, built.text
    kernels = pipeline.checked(pipeline.parse([VARIANTS, REPO / "specs"]))
    new = [k.name for k in kernels if any(k.spec_path.endswith(f.name) for f in FILES)]
    assert all((ws.generated / "kernels" / f"{n}.fatbin").is_file() for n in new)
    verified = ws.kgen("verify")
    assert verified.rc == 1, verified.text  # new kernels, not frozen: the gate fails
    assert all(f"{n} " in verified.out for n in new)
    verified = ws.kgen("verify", "--allow-new")
    assert verified.rc == 0, verified.text
    golden = [ln for ln in verified.out.splitlines() if ln.rstrip().endswith(" identical")]
    assert len(golden) == len(load_golden(REPO / "golden").kernels)
    assert all(f"{n} " in verified.out for n in new)
    # The kernel tests of the scratch build (the new kernels among them), host tiers only
    # (no GPU here).
    env = {**os.environ, "KGEN_GENERATED": str(ws.generated),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-m", "not gpu", "--rootdir", str(REPO),
                           str(REPO / "tests" / "kernels")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout
    ran = {ln.split("::", 1)[1].split("[", 1)[1].split("-", 1)[0] for ln in
           subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only",
                           "-p", "no:cacheprovider", "--rootdir", str(REPO),
                           str(REPO / "tests" / "kernels")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600).stdout.splitlines()
           if "::test_kernel[" in ln}
    assert set(new) <= ran, sorted(set(new) - ran)
