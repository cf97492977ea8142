"""The CuPy module, imported on first use: where the cache objects ask for it, so
nothing needs CuPy before it launches (and a CPU test can stand a fake in)."""

from __future__ import annotations


def cupy():
    import cupy

    return cupy
