"""The wheel as a user installs it: ``kgen dist`` of the repo's build, installed into a
fresh virtual environment (no network: its dependencies are this environment's), gives
the ``kgen`` command, full metadata, and a public call's contract check with no GPU and
no CuPy."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from tc_helpers import REPO

import kgen

pytestmark = pytest.mark.toolchain


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if not (REPO / "generated" / "manifest.json").is_file():
        pytest.skip("no build in generated/ (make build runs before the tests)")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "kgen", "dist", "-o", str(out)], cwd=REPO,
                   check=True, capture_output=True, text=True)
    (made,) = out.glob("kgen-*.whl")
    return made


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("venv") / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    py = root / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet",
                    "--no-deps", "--no-index", str(wheel)], check=True)
    # jinja2, lark, numpy from this environment, behind the venv's own site-packages
    # (a plain path: this environment's .pth files, its editable kgen, stay out).
    site = subprocess.run([str(py), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root


def _run(venv: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KGEN_", "PYTHON"))}
    return subprocess.run(list(argv), cwd=venv, env=env, capture_output=True, text=True,
                          timeout=120)


def test_metadata(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(f"{info}/METADATA").decode())
        entry = z.read(f"{info}/entry_points.txt").decode()
    assert meta["Version"] == kgen.__version__
    assert meta["License-Expression"] == "AGPL-3.0-or-later"
    assert f"{info}/licenses/LICENSE" in names and "kgen/py.typed" in names
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().startswith("# kgen")  # the README as the long description
    assert {"cuda11", "cuda12", "cuda13"} <= set(meta.get_all("Provides-Extra"))
    assert any(c.startswith("Programming Language :: Python :: 3.1")
               for c in meta.get_all("Classifier"))
    assert "kgen = kgen.cli:main" in entry
    # Every kgen package travels (the op registry among them).
    assert "kgen/ops/__init__.py" in names and "kgen_kernels/manifest.json" in names


def test_command_and_doctor(venv):
    kgen_cmd = str(venv / "bin" / "kgen")
    r = _run(venv, kgen_cmd, "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kgen {kgen.__version__}", r
    r = _run(venv, kgen_cmd, "doctor")
    assert r.returncode == 0, r.stderr
    assert "kgen_kernels" in r.stdout and "Traceback" not in r.stderr
    assert "pip install 'kgen[cuda11|cuda12|cuda13]'" in r.stdout  # no CuPy here


def test_contract_check_without_cupy(venv):
    code = """
import numpy as np, kgen, kgen_kernels
from kgen.runtime.contracts import ContractError
assert "site-packages" in kgen.__file__ and "site-packages" in str(kgen_kernels.ROOT)
q = np.zeros((4, 2, 64), np.float32)
lse = np.zeros((2, 4), np.float32)
try:
    kgen.merge_attn_states(q, q, lse, q, lse)
except ContractError as e:
    print("refused:", e)
else:
    raise SystemExit("a host array was accepted")
try:
    import cupy  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("CuPy importable in the fresh environment")
"""
    r = _run(venv, str(venv / "bin" / "python"), "-I", "-c", code)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "output must be a GPU array" in r.stdout and "host memory" in r.stdout
