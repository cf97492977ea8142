"""The CuPy module, imported on first use: where the cache objects ask for it, so
nothing needs CuPy before it launches (and a CPU test can stand a fake in); and the
facts of the current device the runtime plans with (its multiprocessors)."""

from __future__ import annotations

from kgen.ir.target import TARGET, Target


def cupy():
    import cupy

    return cupy


_SMS: dict[int, Target] = {}


def multiprocessors() -> Target:
    """The current device's multiprocessors (their count and per-SM threads, blocks,
    registers and shared memory) on the compile target's per-block limits: what the
    default decode plan fills (asked once per device)."""
    cp = cupy()
    dev = cp.cuda.runtime.getDevice()
    if dev not in _SMS:
        p = cp.cuda.runtime.getDeviceProperties(dev)
        _SMS[dev] = TARGET.on_device(
            int(p["multiProcessorCount"]), p.get("maxThreadsPerMultiProcessor"),
            p.get("maxBlocksPerMultiProcessor"), p.get("regsPerMultiprocessor"),
            p.get("sharedMemPerMultiprocessor"))
    return _SMS[dev]


def sm_count() -> int:
    """Multiprocessors of the current device."""
    return multiprocessors().sms
