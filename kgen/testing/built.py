"""The built tree the tests read (``kgen build specs/`` writes it; it is never
committed): its manifest, or None, and a mark that skips a test without one. The tree is
the one ``kgen_kernels`` loads (kgen.runtime.kernels.locate: ``KGEN_GENERATED``, an
installed wheel, the checkout's generated/)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kgen.runtime import manifest
from kgen.runtime.kernels import locate


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("kgen_kernels")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


try:
    BUILT: manifest.Manifest | None = locate(_package_dir())
except ImportError:
    BUILT = None

GENERATED = BUILT.root if BUILT is not None else Path(__file__).resolve().parents[2] / "generated"

needs_build = pytest.mark.skipif(
    BUILT is None, reason="no built kernels: run `kgen build specs/` (or install a kgen wheel)")
