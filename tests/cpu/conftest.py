"""Fixtures of the pure-Python tier."""

from __future__ import annotations

import numpy as np
import pytest

from kgen import testing


@pytest.fixture
def rng() -> tuple[np.random.Generator, int]:
    """A generator with a fresh seed (or KGEN_TEST_SEED) and that seed, printed."""
    g, seed = testing.rng()
    print(f"KGEN_TEST_SEED={seed}")
    return g, seed
