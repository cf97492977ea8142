"""A stand-in for CuPy where there is no GPU: arrays are attribute bags with what
kgen reads of a cupy.ndarray, kernel functions record their launches. For CPU
tests of the launch path (memo hits, the cache objects' replays) and for timing
its host-side Python (``python -m kgen.bench.host``)."""

from __future__ import annotations

import math
import types

import numpy as np

from kgen.runtime.pending import c_strides as _contiguous


class _Ptr:
    __slots__ = ("device_id", "ptr")

    def __init__(self, device_id: int, ptr: int):
        self.device_id, self.ptr = device_id, ptr


class FakeArray:
    """shape, dtype, strides, ndim, size, flags, data.device_id, device.id; ``host``
    is what ``get`` returns (zeros when None) and what ``set`` writes."""

    __slots__ = ("shape", "dtype", "strides", "ndim", "size", "data", "host")
    _next = [4096]

    def __init__(self, shape, dtype=np.float32, strides=None, device: int = 0, host=None,
                 data: _Ptr | None = None):
        self.shape = tuple(int(n) for n in (shape if isinstance(shape, tuple | list)
                                            else (shape,)))
        self.dtype = np.dtype(dtype)
        self.strides = tuple(strides) if strides else _contiguous(self.shape,
                                                                  self.dtype.itemsize)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        if data is None:
            data = _Ptr(device, FakeArray._next[0])
            # 256-byte aligned, as a CUDA allocation is
            FakeArray._next[0] += -(-(self.size * self.dtype.itemsize + 256) // 256) * 256
        self.data = data
        self.host = host

    def astype(self, dtype, order="K"):
        """A new array of ``dtype`` (its host values converted, where it has them)."""
        host = None if self.host is None else np.asarray(self.host).astype(dtype)
        return FakeArray(self.shape, dtype, device=self.data.device_id, host=host)

    @property
    def flags(self):
        c = self.strides == _contiguous(self.shape, self.dtype.itemsize)
        return types.SimpleNamespace(c_contiguous=c)

    @property
    def device(self):
        return types.SimpleNamespace(id=self.data.device_id)

    def __getitem__(self, key):
        """Leading-axis slices and indices: views on the same memory (with its strides)."""
        if isinstance(key, int):
            return FakeArray(self.shape[1:], self.dtype, self.strides[1:], data=self.data)
        if isinstance(key, slice):
            n = len(range(*key.indices(self.shape[0])))
            return FakeArray((n, *self.shape[1:]), self.dtype, self.strides, data=self.data)
        raise NotImplementedError(key)

    def __setitem__(self, key, value):
        """A copy into the whole array (``out[...] = result``): the result's host values,
        where it has them."""
        if key is not Ellipsis:
            raise NotImplementedError(key)
        host = getattr(value, "host", None)
        self.host = None if host is None else np.asarray(host).astype(self.dtype)

    def get(self, stream=None):
        return np.zeros(self.shape, self.dtype) if self.host is None else self.host

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray) or arr.dtype != self.dtype or \
                arr.shape != self.shape:
            raise TypeError(f"cannot set {arr!r} to {self.dtype} {self.shape}")
        self.host = arr.copy()

    def fill(self, value):
        self.host = np.full(self.shape, value, self.dtype)

    def reshape(self, *shape):
        return FakeArray(shape[0] if len(shape) == 1 else shape, self.dtype, data=self.data)


class FakeStream:
    """A stream: its handle, and the ``with`` form that makes it current."""

    def __init__(self, ptr: int = 0, device_id: int = -1):
        self.ptr, self.device_id = ptr, device_id

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeCupy:
    """The module object: ``cuda.runtime.getDevice`` returns ``device``; ``function``
    makes recorders of (kernel, grid, block, args, shared_mem, stream) into
    ``launched`` (with ``record=False``, functions that do nothing)."""

    ndarray = FakeArray
    float32, float16, int32, uint8, int8 = np.float32, np.float16, np.int32, np.uint8, np.int8

    def __init__(self, record: bool = True):
        self.device = 0
        self.record = record
        self.launched: list[tuple] = []
        fake = self

        class Runtime:
            @staticmethod
            def getDevice():
                return fake.device

            @staticmethod
            def getDeviceProperties(index):
                # A K80 die's multiprocessors (kgen.ir.target.SM_37).
                return {"name": b"kgen fake GPU", "major": 9, "minor": 0,
                        "multiProcessorCount": 13, "maxThreadsPerMultiProcessor": 2048,
                        "maxBlocksPerMultiProcessor": 16, "regsPerMultiprocessor": 131072,
                        "sharedMemPerMultiprocessor": 114688}

            @staticmethod
            def driverGetVersion():
                return 13000

            @staticmethod
            def streamIsCapturing(ptr):
                return fake.capturing


        self.capturing = 0  # what streamIsCapturing answers (1: a capture is active)
        self.cuda = types.SimpleNamespace(runtime=Runtime, Stream=FakeStream,
                                          ExternalStream=FakeStream,
                                          get_current_stream=lambda: FakeStream(0))

    def empty(self, shape, dtype=np.float32):
        return FakeArray(shape, dtype, device=self.device)

    zeros = empty

    def full(self, shape, value, dtype=np.float32):
        return FakeArray(shape, dtype, device=self.device)

    def tile(self, a, reps: int):
        return FakeArray((a.shape[0] * reps, *a.shape[1:]), a.dtype, device=self.device)

    def asarray(self, a, dtype=None):
        a = np.asarray(a, dtype)
        return FakeArray(a.shape, a.dtype, device=self.device, host=a)

    def function(self, path, name: str, device: int):
        launched = self.launched

        def run(grid, block, args, shared_mem=0, stream=None):
            launched.append((name, grid, block, args, shared_mem, stream))

        def idle(grid, block, args, shared_mem=0, stream=None):
            pass
        return run if self.record else idle

    def install(self, monkeypatch) -> FakeCupy:
        """Make kgen's launch path and cache objects use this (pytest monkeypatch)."""
        from kgen.runtime import device, launch

        monkeypatch.setattr(launch, "_cupy", lambda: self)
        monkeypatch.setattr(launch, "_rt", None)
        monkeypatch.setattr(launch, "_memo", {})
        monkeypatch.setattr(launch, "_held", [0])
        monkeypatch.setattr(launch, "function", self.function)
        monkeypatch.setattr(device, "cupy", lambda: self)
        return self


class Guarded(FakeCupy):
    """A fake CuPy that, once ``armed``, records in ``touched`` every allocation,
    upload (``asarray``, and ``set`` on an array), fill, tile and launch: what a call
    that must touch nothing (a refusal) or upload nothing (a graph-capturable step)
    is checked against."""

    def __init__(self):
        super().__init__()
        self.armed, self.touched = False, []

    def _touch(self, what):
        if self.armed:
            self.touched.append(what)

    def empty(self, shape, dtype=np.float32):
        self._touch(("alloc", shape))
        return super().empty(shape, dtype)

    zeros = empty

    def full(self, shape, value, dtype=np.float32):
        self._touch(("full", shape))
        return super().full(shape, value, dtype)

    def asarray(self, a, dtype=None):
        self._touch(("upload", np.shape(a)))
        return super().asarray(a, dtype)

    def tile(self, a, reps):
        self._touch(("tile", a.shape))
        return super().tile(a, reps)

    def function(self, path, name, device):
        fn = super().function(path, name, device)

        def run(*a, **kw):
            self._touch(("launch", name))
            return fn(*a, **kw)
        return run

    def refuses(self, state, match: str, fn, *a, **kw) -> None:
        """``fn(*a, **kw)`` raises a ContractError whose message matches ``match``,
        having touched nothing on the GPU and left ``state()`` as it was."""
        import re

        from kgen.runtime.contracts import ContractError

        before = state()
        self.armed, self.touched = True, []
        try:
            fn(*a, **kw)
        except ContractError as exc:
            assert re.search(match, str(exc)), f"refused with {exc!s}, not {match!r}"
        else:
            raise AssertionError(f"accepted; expected a refusal matching {match!r}")
        finally:
            self.armed = False
        assert self.touched == [], f"touched the GPU before refusing: {self.touched}"
        assert state() == before, "changed its state before refusing"

    def install(self, monkeypatch) -> Guarded:
        """As FakeCupy.install; an array's ``fill`` and ``set`` are recorded too."""
        super().install(monkeypatch)
        fill, put = FakeArray.fill, FakeArray.set

        def filled(a, value):
            self._touch(("fill", a.shape))
            fill(a, value)

        def uploaded(a, arr, stream=None):
            self._touch(("set", a.shape, stream))
            put(a, arr, stream)

        monkeypatch.setattr(FakeArray, "fill", filled)
        monkeypatch.setattr(FakeArray, "set", uploaded)
        return self
