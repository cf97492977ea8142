"""The CuPy module, imported on first use: where the cache objects ask for it, so
nothing needs CuPy before it launches (and a CPU test can stand a fake in); and the
facts of the current device the runtime plans with (its multiprocessors)."""

from __future__ import annotations

from kgen.ir.target import TARGET, Target

CUPY_HINT = ("CuPy is not installed: pip install 'kgen[cuda11|cuda12|cuda13]' by the "
             "driver's CUDA version (nvidia-smi's \"CUDA Version\"); building and verifying "
             "need none")


def cupy():
    try:
        import cupy
    except ModuleNotFoundError as e:
        if e.name != "cupy":
            raise
        raise ModuleNotFoundError(CUPY_HINT, name="cupy") from None
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
