"""The CuPy module, imported on first use: where the cache objects ask for it, so
nothing needs CuPy before it launches (and a CPU test can stand a fake in)."""

from __future__ import annotations


def cupy():
    import cupy

    return cupy


_SMS: dict[int, int] = {}


def sm_count() -> int:
    """Multiprocessors of the current device (asked once per device)."""
    cp = cupy()
    dev = cp.cuda.runtime.getDevice()
    if dev not in _SMS:
        _SMS[dev] = int(cp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])
    return _SMS[dev]
