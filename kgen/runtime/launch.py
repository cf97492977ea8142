"""Hand a bound Launch to CuPy: a module's fatbin is loaded once per device, after
kgen.runtime.loadcheck has decided which of its images the driver will use (or
raised UnloadableError, a ValueError, saying why none can and what to do).

Launches are cheap to repeat: the contracts depend only on the arguments'
shapes, dtypes, layouts, devices and scalar values, so a launch whose
signature was bound before replays that binding with the new arrays (no
contract is re-derived; a different signature binds in full). ``bound``
goes further for a caller that launches the same buffers again and again (a
decode step, a benchmark): bind once, then ``Bound.run`` is a raw launch.
Device-resident positions that are validated (``validate_pos``) are read on
every call, so those launches always bind in full.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kgen.runtime import loadcheck
from kgen.runtime.bind import Launch, bind
from kgen.runtime.contracts import ContractError
from kgen.spec.ir import Kernel

_modules: dict[tuple[str, int], object] = {}
_functions: dict[tuple[str, int, str], object] = {}
_memo: dict[tuple, tuple[Launch, tuple[bool, ...]]] = {}
_lock = threading.Lock()
MEMO_LIMIT = 4096  # signatures remembered before the memo starts over


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


def function(path: Path, kernel: str, device: int):
    key = (str(path), device, kernel)
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = module(path).get_function(kernel)
    return fn


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


def _signature(kernel: Kernel, args: dict, ndarray, device: int) -> tuple | None:
    """Everything the contracts of a launch depend on, or None when they also depend
    on device memory (validated device positions)."""
    if args.get("validate_pos") and "pos" in args:
        return None
    sig = [id(kernel), device]
    for v in args.values():
        if type(v) is ndarray:
            if v.data.device_id != device:
                return None  # let bind + check_device say what is wrong
            sig.append((v.shape, v.dtype.char, v.strides))
        elif v is None or type(v) in (int, float, bool):
            sig.append(v)
        else:
            return None  # anything else binds in full (and is refused there if wrong)
    return tuple(sig)


def _bind(kernel: Kernel, args: dict, device: int) -> Launch:
    cp = _cupy()
    sig = _signature(kernel, args, cp.ndarray, device)
    hit = _memo.get(sig) if sig is not None else None
    if hit is not None and hit[0].kernel == kernel.name:
        b, is_array = hit
        new = tuple(args[n] if a else v for n, a, v in zip(b.names, is_array, b.args,
                                                             strict=True))
        return Launch(b.kernel, b.grid, b.block, b.shared_bytes, new, b.names)
    b = bind(kernel, args)
    check_device(b)
    if sig is not None:
        if len(_memo) >= MEMO_LIMIT:
            _memo.clear()
        _memo[sig] = (b, tuple(not isinstance(v, np.generic) for v in b.args))
    return b


def launch(kernel: Kernel, path: Path, args: dict, stream=None) -> Launch:
    """Bind (all contracts, or a remembered binding of the same signature), then
    launch on ``stream``."""
    device = _cupy().cuda.runtime.getDevice()
    b = _bind(kernel, args, device)
    function(path, kernel.name, device)(b.grid, b.block, b.args, shared_mem=b.shared_bytes,
                                        stream=stream)
    return b


@dataclass(frozen=True)
class Bound:
    """A launch bound once (every contract checked): ``run`` is a raw launch."""

    launch: Launch
    fn: object

    def run(self, stream=None) -> None:
        b = self.launch
        self.fn(b.grid, b.block, b.args, shared_mem=b.shared_bytes, stream=stream)


def bound(kernel: Kernel, path: Path, args: dict) -> Bound:
    device = _cupy().cuda.runtime.getDevice()
    b = bind(kernel, args)
    check_device(b)
    return Bound(b, function(path, kernel.name, device))


_SIGS: dict[object, object] = {}


def bound_call(launcher, *arrays, **kw) -> Bound:
    """``launcher(*arrays, **kw)`` bound once instead of launched: a generated
    launcher's arguments, checked in full; ``run`` then replays it raw."""
    import inspect
    import sys

    sig = _SIGS.get(launcher)
    if sig is None:
        sig = _SIGS[launcher] = inspect.signature(launcher)
    ba = sig.bind(*arrays, **kw)
    ba.apply_defaults()
    args = dict(ba.arguments)
    args.pop("stream", None)
    mod = sys.modules[launcher.__module__]
    path = getattr(mod, "FATBIN", None) or mod.PTX
    return bound(mod.KERNELS[launcher.__name__], path, args)
