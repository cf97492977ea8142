"""Make generated/ importable as ``kgen_kernels`` where kgen is not installed
(a GPU machine that has only the checkout on PYTHONPATH)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[2] / "generated"


def ensure_kgen_kernels(generated: Path = DEFAULT) -> None:
    if "kgen_kernels" in sys.modules or importlib.util.find_spec("kgen_kernels") is not None:
        return
    init = generated / "__init__.py"
    if not init.is_file():
        return
    spec = importlib.util.spec_from_file_location(
        "kgen_kernels", init, submodule_search_locations=[str(generated)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kgen_kernels"] = mod
    spec.loader.exec_module(mod)
