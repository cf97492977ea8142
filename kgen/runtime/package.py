"""Point ``kgen_kernels`` at a built tree: the one the settings name
(``KGEN_GENERATED``), the installed package, or a tree given by path (a scratch
build of other specs, as the toolchain tests make)."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

from kgen.runtime.kernels import PACKAGE, expose


def _drop() -> None:
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def ensure_kgen_kernels(generated: Path | None = None) -> None:
    """Make ``kgen_kernels`` the launchers of ``generated`` (default: wherever the
    package finds its artifacts) unless that very tree is loaded already. Without a
    built tree anywhere nothing is loaded, and ``import kgen_kernels`` raises the
    ImportError that says what to run."""
    wanted = Path(generated).resolve() if generated is not None else None
    loaded = sys.modules.get(PACKAGE)
    root = getattr(loaded, "ROOT", None)
    if loaded is not None and root is not None and wanted in (None, root):
        return
    _drop()
    if wanted is None:
        try:
            importlib.import_module(PACKAGE)
            return
        except ModuleNotFoundError as exc:
            if exc.name != PACKAGE:
                raise
        except ImportError:
            return  # nothing built anywhere
    mod = types.ModuleType(PACKAGE, "kgen_kernels, made from a built tree by path")
    mod.__path__ = []  # a package: its modules are registered by expose
    try:
        expose(mod.__dict__, None, directory=wanted)
    except ImportError:
        _drop()
        return
    sys.modules[PACKAGE] = mod


def generated() -> list[tuple]:
    """Every generated kernel (its IR, kgen.runtime.record.Built) with its launcher, in
    the generated package's order."""
    ensure_kgen_kernels()
    import kgen_kernels

    return [(k, getattr(mod, name)) for mod in kgen_kernels.MODULES.values()
            for name, k in mod.KERNELS.items()]
