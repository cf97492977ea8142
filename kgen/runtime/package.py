"""Make a generated/ tree importable as ``kgen_kernels``: the installed one, or
the tree the settings name (``KGEN_GENERATED``), e.g. a GPU machine that has
only the checkout on PYTHONPATH, or a scratch build of other specs."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[2] / "generated"


def _wanted() -> Path:
    env = os.environ.get("KGEN_GENERATED")
    return Path(env).resolve() if env else DEFAULT


def ensure_kgen_kernels(generated: Path | None = None) -> None:
    """Import ``generated`` (default: KGEN_GENERATED, else the checkout's
    generated/) as ``kgen_kernels`` unless that very tree is already the one
    importable under the name."""
    generated = (generated or _wanted()).resolve()
    loaded = sys.modules.get("kgen_kernels")
    if loaded is not None:
        if Path(loaded.__file__).resolve().parent == generated:
            return
    else:
        spec = importlib.util.find_spec("kgen_kernels")
        if spec is not None and spec.origin and Path(spec.origin).resolve().parent == generated:
            return
    init = generated / "__init__.py"
    if not init.is_file():
        return
    for name in [n for n in sys.modules if n == "kgen_kernels" or
                 n.startswith("kgen_kernels.")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        "kgen_kernels", init, submodule_search_locations=[str(generated)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kgen_kernels"] = mod
    spec.loader.exec_module(mod)
