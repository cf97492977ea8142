"""The built tree the tests read (``kgen build specs/`` writes it; it is never
committed): its manifest, or None, and a mark that skips a test without one. The tree is
the one ``kgen_kernels`` loads (kgen.runtime.kernels.locate: ``KGEN_GENERATED``, an
installed wheel, the checkout's generated/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kgen.runtime import manifest
from kgen.runtime.kernels import installed_dir, locate

try:
    BUILT: manifest.Manifest | None = locate(installed_dir())
except ImportError:
    BUILT = None

GENERATED = BUILT.root if BUILT is not None else Path(__file__).resolve().parents[2] / "generated"

needs_build = pytest.mark.skipif(
    BUILT is None, reason="no built kernels: run `kgen build specs/` (or install a kgen wheel)")
