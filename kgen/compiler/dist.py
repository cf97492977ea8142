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

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from kgen import __version__
from kgen.compiler import cpp_api
from kgen.config import Settings
from kgen.errors import KgenError
from kgen.runtime import manifest

LOADER = Path(__file__).resolve().parents[1] / "kgen_kernels" / "__init__.py"
EPOCH = "315532800"  # 1980-01-01, the earliest time a zip entry can carry
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "kgen_kernels")
SETUPTOOLS = 77  # the oldest setuptools that writes a licence expression (PEP 639)


# What the wheel's metadata carries over from the checkout's [project] table, as it is.
_CARRIED = ("name", "description", "readme", "license", "license-files", "requires-python",
            "keywords", "classifiers", "authors", "urls", "dependencies",
            "optional-dependencies", "scripts")


def _toml(value) -> str:
    """A TOML value of the [project] table's kinds: strings, lists, inline tables."""
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML spelling for {value!r}")


def _pyproject(project: dict, packages: list[str]) -> str:
    meta = {k: project[k] for k in _CARRIED if k in project}
    meta["description"] = meta.get("description", "kgen") + " (with its built kernels)"
    table = "\n".join(f"{k} = {_toml(v)}" for k, v in meta.items())
    pkgs = ", ".join(f'"{p}"' for p in packages)
    return f'''[build-system]
requires = ["setuptools>={SETUPTOOLS}"]
build-backend = "setuptools.build_meta"

[project]
version = "{__version__}"
{table}

[tool.setuptools]
packages = [{pkgs}]
include-package-data = false

[tool.setuptools.package-data]
kgen_kernels = ["{manifest.MANIFEST}", "*.h", "{cpp_api.HEADER}", "{cpp_api.SOURCE}",
                "{manifest.KERNELS_DIR}/*.fatbin", "{manifest.SOURCES_DIR}/*.cu"]
kgen = ["compiler/spec/*.lark", "py.typed"]
'''


def _isolated() -> bool:
    """Whether pip must build in an isolated environment: this one's setuptools is
    older than the metadata needs (a licence expression, a built-in bdist_wheel)."""
    try:
        have = version("setuptools")
    except PackageNotFoundError:
        return True
    return tuple(int(x) for x in re.findall(r"\d+", have)[:2]) < (SETUPTOOLS, 0)


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
        for name in ("README.md", "LICENSE"):  # the metadata's readme and licence files
            shutil.copy2(settings.root / name, stage / name)
        for p in stage.rglob("*"):
            os.utime(p, (int(EPOCH), int(EPOCH)))
        env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH}
        wheels = Path(tmp) / "wheels"
        # This environment's setuptools when it is new enough (no download); else pip
        # fetches one into an isolated build environment.
        isolated = _isolated()
        isolation = [] if isolated else ["--no-build-isolation"]
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation,
             "--quiet", "-w", str(wheels), str(stage)],
            capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            hint = (f"\n(kgen dist needs setuptools>={SETUPTOOLS}: "
                    f"pip install 'setuptools>={SETUPTOOLS}', or network access for pip's "
                    "isolated build)") if isolated else ""
            raise KgenError("pip wheel failed:\n" + (proc.stdout + proc.stderr).strip() + hint)
        (made,) = wheels.glob("*.whl")
        target = out / made.name
        shutil.copy2(made, target)
    return target
