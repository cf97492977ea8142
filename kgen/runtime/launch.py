"""Hand a bound Launch to CuPy: a module's fatbin is loaded once per device, after
kgen.runtime.loadcheck has decided which of its images the driver will use (or
raised UnloadableError, a ValueError, saying why none can and what to do)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from kgen.runtime import loadcheck
from kgen.runtime.bind import Launch, bind
from kgen.runtime.contracts import ContractError
from kgen.spec.ir import Kernel

_modules: dict[tuple[str, int], object] = {}
_lock = threading.Lock()


def _cupy():
    import cupy

    return cupy


def module(image: Path):
    """The cupy.RawModule for a load artifact (a module's .fatbin; a .ptx loads too)
    on the current device, loaded once. Before the driver sees it, the device's
    compute capability and driver version are checked against what it offers."""
    cp = _cupy()
    dev = cp.cuda.runtime.getDevice()
    key = (str(image), dev)
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            loadcheck.require(Path(image), loadcheck.cupy_device(cp, dev))
            mod = cp.RawModule(path=str(image))
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


def launch(kernel: Kernel, image: Path, args: dict, stream=None) -> Launch:
    """Bind (all contracts), check devices, then launch on ``stream`` from the module
    at ``image`` (the generated launchers pass their module's fatbin)."""
    b = bind(kernel, args)
    check_device(b)
    fn = module(image).get_function(kernel.name)
    fn(b.grid, b.block, b.args, shared_mem=b.shared_bytes, stream=stream)
    return b
