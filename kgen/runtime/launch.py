"""Hand a bound Launch to CuPy: the PTX is loaded once per module and device."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from kgen.runtime.bind import Launch, bind
from kgen.runtime.contracts import ContractError
from kgen.spec.ir import Kernel

_modules: dict[tuple[str, int], object] = {}
_lock = threading.Lock()


def _cupy():
    import cupy

    return cupy


def module(ptx: Path):
    """The cupy.RawModule for a PTX file on the current device (loaded once)."""
    cp = _cupy()
    key = (str(ptx), cp.cuda.runtime.getDevice())
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            # sm_37 PTX: the driver JIT-compiles it for the device at hand.
            mod = cp.RawModule(path=str(ptx))
            _modules[key] = mod
        return mod


def check_device(launch: Launch) -> None:
    """Every array argument is a CuPy array on the current device."""
    cp = _cupy()
    dev = cp.cuda.runtime.getDevice()
    for name, v in zip(launch.names, launch.args, strict=True):
        if hasattr(v, "shape") and not isinstance(v, np.generic):  # arrays, not scalars
            if not isinstance(v, cp.ndarray):
                raise ContractError(launch.kernel, "device",
                                    f"{name} must be a cupy array on the GPU, not "
                                    f"{type(v).__module__}.{type(v).__name__}")
            if v.device.id != dev:
                raise ContractError(launch.kernel, "device",
                                    f"{name} lives on device {v.device.id}; the launch "
                                    f"runs on device {dev}")


def launch(kernel: Kernel, ptx: Path, args: dict, stream=None) -> Launch:
    """Bind (all contracts), check devices, then launch on ``stream``."""
    b = bind(kernel, args)
    check_device(b)
    fn = module(ptx).get_function(kernel.name)
    fn(b.grid, b.block, b.args, shared_mem=b.shared_bytes, stream=stream)
    return b
