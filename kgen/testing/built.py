"""The built tree the tests read (``kgen build specs/`` writes it; it is never
committed): its manifest, or None, and a mark that skips a test without one."""

from __future__ import annotations

from pathlib import Path

import pytest

from kgen.runtime import manifest

CHECKOUT = Path(__file__).resolve().parents[2]
GENERATED = CHECKOUT / "generated"
TESTS_GENERATED = CHECKOUT / "tests" / "generated"

try:
    BUILT: manifest.Manifest | None = manifest.read(GENERATED)
except manifest.ManifestError:
    BUILT = None

needs_build = pytest.mark.skipif(
    BUILT is None, reason=f"no built kernels in {GENERATED}: run `kgen build specs/`")
