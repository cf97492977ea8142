"""``kgen dist``: a wheel of kgen with the kernels the last build made, for hosts that
have a driver but no toolchain (a K80 host, a GPU machine).

The wheel holds the ``kgen`` package (its runtime, references and test harness) and
``kgen_kernels``: its loader (kgen/kgen_kernels/__init__.py) with the build's
manifest, fatbins, sources and C header beside it, so ``import kgen_kernels`` there
finds its artifacts in its own directory. It is made from a staging tree with
setuptools through pip, with the timestamps fixed, so the same build gives the same
wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from kgen.compiler import cpp_api
from kgen.config import Settings
from kgen.errors import KgenError
from kgen.runtime import manifest

LOADER = Path(__file__).resolve().parents[1] / "kgen_kernels" / "__init__.py"
EPOCH = "315532800"  # 1980-01-01, the earliest time a zip entry can carry
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "kgen_kernels")


def _pyproject(project: dict, packages: list[str]) -> str:
    deps = ", ".join(f'"{d}"' for d in project.get("dependencies", ()))
    pkgs = ", ".join(f'"{p}"' for p in packages)
    return f'''[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{project["name"]}"
version = "{project["version"]}"
description = "{project.get("description", "")} (with its built kernels)"
requires-python = "{project.get("requires-python", ">=3.11")}"
dependencies = [{deps}]

[tool.setuptools]
packages = [{pkgs}]
include-package-data = false

[tool.setuptools.package-data]
kgen_kernels = ["{manifest.MANIFEST}", "*.h", "{cpp_api.HEADER}", "{cpp_api.SOURCE}",
                "{manifest.KERNELS_DIR}/*.fatbin", "{manifest.SOURCES_DIR}/*.cu"]
kgen = ["compiler/spec/*.lark"]
'''


def _packages(root: Path) -> list[str]:
    return sorted(".".join(p.parent.relative_to(root).parts)
                  for p in (root / "kgen").rglob("__init__.py"))


def wheel(settings: Settings, out: Path) -> Path:
    """Write the wheel into ``out``; its path."""
    built = manifest.read(settings.generated)  # ManifestError: nothing built yet
    project = tomllib.loads((settings.root / "pyproject.toml").read_text("utf-8"))["project"]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kgen-dist-") as tmp:
        stage = Path(tmp) / "stage"
        shutil.copytree(settings.root / "kgen", stage / "kgen", ignore=_SKIP)
        kk = stage / "kgen_kernels"
        kk.mkdir()
        shutil.copy2(LOADER, kk / "__init__.py")
        # The C++ host API beside the C header: a C++ caller builds kgen_launch.cpp
        # from the installed package (kgen_kernels.ROOT) and loads its fatbins from there.
        for name in (manifest.MANIFEST, built.c_header, cpp_api.HEADER, cpp_api.SOURCE):
            shutil.copy2(settings.generated / name, kk / name)
        for sub in (manifest.KERNELS_DIR, manifest.SOURCES_DIR):
            shutil.copytree(settings.generated / sub, kk / sub)
        (stage / "pyproject.toml").write_text(
            _pyproject(project, [*_packages(stage), "kgen_kernels"]), "utf-8")
        for p in stage.rglob("*"):
            os.utime(p, (int(EPOCH), int(EPOCH)))
        env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH}
        wheels = Path(tmp) / "wheels"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
             "--quiet", "-w", str(wheels), str(stage)],
            capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise KgenError("pip wheel failed:\n" + (proc.stdout + proc.stderr).strip())
        (made,) = wheels.glob("*.whl")
        target = out / made.name
        shutil.copy2(made, target)
    return target
