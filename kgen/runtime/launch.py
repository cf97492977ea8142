"""Hand a bound Launch to CuPy: a module's fatbin is loaded once per device, after
kgen.runtime.loadcheck has decided which of its images the driver will use (or
raised UnloadableError, a ValueError, saying why none can and what to do).

Launches are cheap to repeat: the contracts depend only on the arguments'
types, shapes, dtypes, strides, devices and scalar values, and on where the arrays
start (their alignment), so a launch whose signature was bound before replays that
binding with the new arrays (no contract is re-derived; a different signature binds
in full). Only arrays on an ALIGN_MAX boundary, which meets every alignment contract,
are replayed: a launch with any array off one binds in full. ``bound``
goes further for a caller that launches the same buffers again and again (a
decode step, a benchmark): bind once, then ``Bound.run`` is a raw launch.
A binding that reads device memory (positions, block tables, seq lens and slot
maps validated with ``validate_pos``) holds for that memory's contents only, so
those launches always bind in full.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import reduce
from math import copysign
from operator import attrgetter, itemgetter, or_
from pathlib import Path

import numpy as np

from kgen.ir.kernel import Kernel
from kgen.runtime import loadcheck
from kgen.runtime.bind import Launch, bind, reads_device
from kgen.runtime.contracts import ALIGN_MAX, ContractError
from kgen.runtime.pending import Pending, made

_modules: dict[tuple[str, int], object] = {}
_functions: dict[tuple[str, int, str], object] = {}
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
    """Every array argument is a CuPy array on the current device (or a Pending, which
    its caller makes there once the launch is checked)."""
    cp = _cupy()
    dev = cp.cuda.runtime.getDevice()
    for name, v in zip(launch.names, launch.args, strict=True):
        if hasattr(v, "shape") and not isinstance(v, np.generic | Pending):  # arrays
            _on_device(launch.kernel, name, v, cp.ndarray, dev)


def check_array(kernel: str, name: str, v) -> None:
    """``v`` is a CuPy array on the current device."""
    cp = _cupy()
    _on_device(kernel, name, v, cp.ndarray, cp.cuda.runtime.getDevice())


def _on_device(kernel: str, name: str, v, ndarray, dev: int) -> None:
    if not isinstance(v, ndarray):
        raise ContractError(kernel, "device", f"{name} must be a cupy array on the GPU, not "
                            f"{type(v).__module__}.{type(v).__name__}")
    if v.device.id != dev:
        raise ContractError(kernel, "device", f"{name} lives on device {v.device.id}; the "
                            f"launch runs on device {dev}")


# ---- the memo -------------------------------------------------------------------------
# Per kernel object and argument names (in the caller's order): the bindings made,
# keyed by everything the contracts read besides device memory: the current
# device, each array's exact type, shape, dtype, strides and device, each
# scalar's exact type and value. A hit replays the binding with the call's arrays;
# the scalars it launches are the converted values of an equal call (a float
# zero's sign is compared apart: -0.0 == 0.0). Array objects are never part of a
# key (ids are reused after garbage collection): a new array of the same
# signature hits. Bindings that read device memory (validated positions) are
# never remembered, nor are those of an array off an ALIGN_MAX boundary, and a call
# with one binds in full: a replay needs no alignment contract checked again.

_SCALARS = frozenset({int, float, bool, type(None)})  # exact types; others bind in full
_PROPS = attrgetter("__class__", "shape", "dtype", "strides", "data.device_id")
_ADDRESS = attrgetter("data.ptr")
_LOW = ALIGN_MAX - 1  # the address bits of an array off an ALIGN_MAX boundary


def _off_boundary(arrays) -> int:
    """Nonzero where an array of ``arrays`` starts off an ALIGN_MAX boundary."""
    return reduce(or_, map(_ADDRESS, arrays), 0) & _LOW
_tuple_new = tuple.__new__
_memo: dict[int, _Kernel] = {}  # id(kernel) -> its memo (which holds the kernel)
_held = [0]  # bindings remembered, all kernels together
_rt: tuple | None = None  # (cupy.ndarray, cupy.cuda.runtime.getDevice), once imported


def _runtime() -> tuple:
    global _rt
    cp = _cupy()
    _rt = (cp.ndarray, cp.cuda.runtime.getDevice)
    return _rt


def _getter(idx: list[int]):
    """``vals`` -> the tuple of ``vals[i]`` for ``i`` in ``idx`` (any length)."""
    if idx and idx == list(range(idx[0], idx[-1] + 1)):
        return itemgetter(slice(idx[0], idx[-1] + 1))  # a run: one slice
    if len(idx) >= 2:
        return itemgetter(*idx)
    if idx:
        i = idx[0]
        return lambda vals: (vals[i],)
    return lambda vals: ()


class _Layout:
    """One kernel's arguments by name: which are arrays, which scalars (fixed by the
    first binding remembered), and the bindings remembered for them: key ->
    (Launch, tail, pick, function, path, float zeros): the launch arguments are
    the call's arrays + tail, or else pick(arrays + Launch.args); ``last`` is the
    latest hit."""

    __slots__ = ("names", "arrays", "scalars", "is_array", "entries", "last")

    def __init__(self, names: tuple, is_array: tuple):
        self.names, self.is_array = names, is_array
        self.arrays = _getter([i for i, a in enumerate(is_array) if a])
        self.scalars = _getter([i for i, a in enumerate(is_array) if not a])
        self.entries: dict[tuple, tuple] = {}
        self.last: tuple = ((), None)

    def key(self, device: int, vals: tuple) -> tuple:
        """Types before values: comparing keys never calls an array's ``==``."""
        scalars = self.scalars(vals)
        return (device, *map(type, scalars), *map(_PROPS, self.arrays(vals)), *scalars)


class _Kernel:
    __slots__ = ("kernel", "layouts", "last")

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.layouts: dict[tuple, _Layout] = {}
        self.last: _Layout | None = None


def _remember(kernel: Kernel, names: tuple, vals: tuple, b: Launch, fn, path, device: int,
              ndarray) -> None:
    """Keep ``b`` for replays, unless its arguments' types rule that out."""
    types = tuple(map(type, vals))
    if any(t is not ndarray and t not in _SCALARS for t in types):
        return
    is_array = tuple(t is ndarray for t in types)
    at = [i for i, a in enumerate(is_array) if a]  # where the call's arrays sit
    if _off_boundary(vals[i] for i in at):
        return  # a replay checks no alignment: only arrays that meet every contract
    pick = []  # the launch arguments from (call's arrays) + b.args
    for j, (name, v) in enumerate(zip(b.names, b.args, strict=True)):
        if isinstance(v, np.generic):
            pick.append(len(at) + j)
            continue
        i = names.index(name) if name in names else -1
        if i < 0 or vals[i] is not v or not is_array[i]:
            return  # not an argument passed through as given: never replayed
        pick.append(at.index(i))
    n = len(at)
    # The common case, the call's arrays in order, then scalars: arrays + tail.
    tail = b.args[n:] if pick == list(range(n)) + list(range(2 * n, n + len(b.args))) \
        else None
    zeros = tuple((i, copysign(1.0, v)) for i, v in enumerate(vals)
                  if type(v) is float and v == 0.0)
    if _held[0] >= MEMO_LIMIT:
        _memo.clear()
        _held[0] = 0
    km = _memo.get(id(kernel))
    if km is None or km.kernel is not kernel:
        km = _memo[id(kernel)] = _Kernel(kernel)
    lay = km.layouts.get(names)
    if lay is None:
        lay = km.layouts[names] = _Layout(names, is_array)
    elif lay.is_array != is_array:
        return  # arrays where the layout has scalars (or back): binds in full
    # Kept without the call's arrays (a hit supplies its own): the memo pins no memory.
    b = b._replace(args=tuple(v if isinstance(v, np.generic) else None for v in b.args))
    lay.entries[lay.key(device, vals)] = (b, tail, itemgetter(*pick), fn, path, zeros)
    _held[0] += 1


def launch(kernel: Kernel, path: Path, args, stream=None, names: tuple | None = None
           ) -> Launch:
    """Bind (all contracts, or a remembered binding of the same signature), then
    launch on ``stream``. ``args``: argument name -> value, or (what the generated
    launchers pass) the values alone in the order of ``names``."""
    if names is None:
        names, args = tuple(args), tuple(args.values())
    ndarray, get_device = _rt or _runtime()
    device = get_device()
    km = _memo.get(id(kernel))
    if km is not None and km.kernel is kernel:
        lay = km.last
        if lay is None or (lay.names is not names and lay.names != names):
            lay = km.last = km.layouts.get(names)
        if lay is not None:
            try:  # lay.key(device, args), inline
                scalars, arrays = lay.scalars(args), lay.arrays(args)
                key = (device, *map(type, scalars), *map(_PROPS, arrays), *scalars)
                last_key, hit = lay.last
                if key != last_key:
                    hit = lay.entries.get(key)
                    if hit is not None:
                        lay.last = (key, hit)
                if hit is not None and _off_boundary(arrays):
                    hit = None  # an array off the boundary: its alignment checked in full
            except (AttributeError, IndexError, TypeError):
                hit = None  # not arrays where the layout has them, or unhashable: in full
            if hit is not None:
                b, tail, pick, fn, held, zeros = hit
                if not zeros or all(copysign(1.0, args[i]) == s for i, s in zeros):
                    new = arrays + tail if tail is not None else pick(arrays + b.args)
                    if held is not path:
                        fn = function(path, kernel.name, device)
                    fn(b.grid, b.block, new, shared_mem=b.shared_bytes, stream=stream)
                    return _tuple_new(Launch, (b.kernel, b.grid, b.block, b.shared_bytes,
                                               new, b.names))
    given = dict(zip(names, args, strict=True))
    b = bind(kernel, given)
    check_device(b)
    fn = function(path, kernel.name, device)
    if not reads_device(kernel, given):
        _remember(kernel, names, args, b, fn, path, device, ndarray)
    fn(b.grid, b.block, b.args, shared_mem=b.shared_bytes, stream=stream)
    return b


class Replay:
    """Launches bound together (every contract checked, no device memory read),
    replayed raw with the caller's arrays in the ``swap`` slots, (index of the
    launch, argument name) each. ``check`` compares the current device and every
    array's type, shape, dtype, strides and device, the swapped-in ones and the
    ones kept alike, with those of the binding, and asks every array on an ALIGN_MAX
    boundary: where anything differs it returns None (the caller then launches in
    full, and gets the contracts' errors), else what ``run`` launches. A binding with
    an array off the boundary is no Replay (ValueError)."""

    __slots__ = ("kept", "signature", "calls")

    def __init__(self, bound: list[tuple[Launch, object]], swap: tuple[tuple[int, str], ...],
                 device: int):
        ndarray = (_rt or _runtime())[0]
        slots = {(i, bound[i][0].names.index(name)): s for s, (i, name) in enumerate(swap)}
        kept: list = []
        for i, (b, _) in enumerate(bound):
            for j, v in enumerate(b.args):
                if (i, j) not in slots and not isinstance(v, np.generic) and \
                        not any(v is x for x in kept):
                    kept.append(v)
        self.kept = tuple(kept)
        arrays = (*(bound[i][0].arg(name) for i, name in swap), *kept)
        if any(type(a) is not ndarray for a in arrays):
            raise TypeError("Replay binds cupy.ndarray arguments only")
        if _off_boundary(arrays):
            raise ValueError(f"Replay binds arrays on {ALIGN_MAX}-byte boundaries only")
        self.signature = (device, *map(_PROPS, arrays))
        calls = []
        for i, (b, fn) in enumerate(bound):
            pick = [slots[(i, j)] if (i, j) in slots else
                    len(arrays) + j if isinstance(v, np.generic) else
                    len(swap) + next(k for k, x in enumerate(kept) if x is v)
                    for j, v in enumerate(b.args)]
            scalars = tuple(v if isinstance(v, np.generic) else None for v in b.args)
            calls.append((fn, b.grid, b.block, b.shared_bytes, scalars, itemgetter(*pick)))
        self.calls = tuple(calls)

    def check(self, swap: tuple) -> tuple | None:
        arrays = swap + self.kept
        try:
            signature = ((_rt or _runtime())[1](), *map(_PROPS, arrays))
            if _off_boundary(swap):
                return None
        except AttributeError:
            return None
        return arrays if signature == self.signature else None

    def run(self, arrays: tuple, stream=None) -> None:
        for fn, grid, block, shared, args, pick in self.calls:
            fn(grid, block, pick(arrays + args), shared_mem=shared, stream=stream)


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


_SIGS: dict[object, tuple] = {}  # launcher -> (names, how many arrays, defaults)


def _arguments(launcher, arrays: tuple, kw: dict) -> dict:
    """A generated launcher's arguments by name, as a call binds them (its arrays
    positional or by name, its scalars keyword-only), defaults filled in, in its
    order; no stream."""
    spec = _SIGS.get(launcher)
    if spec is None:
        code = launcher.__code__
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        spec = _SIGS[launcher] = (tuple(n for n in names if n != "stream"), code.co_argcount,
                                  dict(launcher.__kwdefaults__ or {}))
    names, n_arrays, defaults = spec
    clash = set(names[:len(arrays)]) & set(kw)
    unknown = set(kw) - set(names) - {"stream"}
    if len(arrays) > n_arrays or clash or unknown:
        raise ContractError(launcher.kernel.name, "arguments", f"takes {', '.join(names)} "
                            f"(the first {n_arrays} positional); got {len(arrays)} positional"
                            + "".join(f", {n} twice" for n in sorted(clash))
                            + "".join(f", {n}" for n in sorted(unknown)))
    args = {**defaults, **kw, **dict(zip(names[:len(arrays)], arrays, strict=True))}
    missing = [n for n in names if n not in args]
    if missing:
        raise ContractError(launcher.kernel.name, "arguments", f"{', '.join(missing)} not "
                            "given")
    return {n: args[n] for n in names}


def bound_call(launcher, *arrays, **kw) -> Bound:
    """``launcher(*arrays, **kw)`` bound once instead of launched: a generated
    launcher's arguments, checked in full; ``run`` then replays it raw."""
    return bound(launcher.kernel, launcher.fatbin, _arguments(launcher, arrays, kw))


def check_call(launcher, *arrays, **kw) -> Launch | None:
    """``launcher(*arrays, **kw)`` checked, not launched: every contract of its kernel,
    and every array on the current device (a Pending as the array it will be made).
    Nothing is loaded or launched. A call of the signature of one launched before
    (the memo's key) passed these checks then: None; any other binds in full and
    returns the binding, for launch_checked."""
    args = _arguments(launcher, arrays, kw)
    if _launched_like(launcher.kernel, args):
        return None
    b = bind(launcher.kernel, args)
    check_device(b)
    return b


def launch_checked(launcher, b: Launch, arrays: tuple, kw: dict, stream=None) -> Launch:
    """Launch ``b``, which check_call bound from these arguments (now with every
    Pending made), without checking it again; remembered as ``launch`` would."""
    args = _arguments(launcher, arrays, kw)
    b = b._replace(args=tuple(made(v) for v in b.args))
    ndarray, get_device = _rt or _runtime()
    device = get_device()
    kernel, path = launcher.kernel, launcher.fatbin
    fn = function(path, kernel.name, device)
    if not reads_device(kernel, args):
        _remember(kernel, tuple(args), tuple(args.values()), b, fn, path, device, ndarray)
    fn(b.grid, b.block, b.args, shared_mem=b.shared_bytes, stream=stream)
    return b


def _launched_like(kernel: Kernel, args: dict) -> bool:
    """Whether the memo holds a binding of ``args``' signature."""
    km = _memo.get(id(kernel))
    lay = km.layouts.get(tuple(args)) if km is not None and km.kernel is kernel else None
    if lay is None:
        return False
    ndarray, get_device = _rt or _runtime()
    device = get_device()
    vals = tuple(args.values())
    scalars = lay.scalars(vals)

    def props(a):
        return (ndarray, a.shape, a.dtype, a.strides, device) if type(a) is Pending \
            else _PROPS(a)
    try:
        arrays = lay.arrays(vals)
        hit = lay.entries.get((device, *map(type, scalars), *map(props, arrays),
                               *scalars))
        if _off_boundary(a for a in arrays if type(a) is not Pending):
            return False  # its alignment contracts checked in full
    except (AttributeError, IndexError, TypeError):
        return False
    return hit is not None and all(copysign(1.0, vals[i]) == s for i, s in hit[-1])
