"""Arrays a cache call makes only once every launch it will make is checked (an
output, scratch, an uploaded block table, the staged decode position): the
contracts read their shape, dtype and (for uploads) host values, and
kgen.runtime.launch.check_device knows them as arrays still to be made on the
current device."""

from __future__ import annotations

import math
import types

import numpy as np

from kgen.runtime import device


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array of ``shape``."""
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


class Pending:
    """An array a call makes only once its launches are checked: what the contracts
    read of it (shape, dtype, rank, size, contiguity and, for the index tensors a
    call uploads, the host values it will hold), and ``make`` for the real one, a
    C-contiguous array on the current device."""

    __slots__ = ("shape", "dtype", "ndim", "size", "strides", "host", "_make", "_made")
    flags = types.SimpleNamespace(c_contiguous=True)

    def __init__(self, shape: tuple[int, ...], dtype, make, host: np.ndarray | None = None):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        self.strides = c_strides(self.shape, self.dtype.itemsize)  # as it will be made
        self.host, self._make, self._made = host, make, None

    def get(self, stream=None) -> np.ndarray:
        """The values a position or index check reads (an upload's host copy)."""
        assert self.host is not None, "only an upload's values are read before it is made"
        return self.host

    def __getitem__(self, key: slice) -> Pending:
        """A leading-axis slice (a chunk of a batch's output), made from the whole."""
        n = len(range(*key.indices(self.shape[0])))
        return Pending((n, *self.shape[1:]), self.dtype, lambda: self.made()[key])

    def reshape(self, *shape: int) -> Pending:
        """The same elements in ``shape`` (a view of the whole: a batch's output as the
        combine's heads)."""
        assert math.prod(shape) == self.size, (shape, self.shape)
        return Pending(shape, self.dtype, lambda: self.made().reshape(shape))

    def made(self):
        if self._made is None:
            self._made = self._make()
        return self._made


def empty(shape: tuple[int, ...], dtype=np.float32) -> Pending:
    """An output array, allocated once the call is checked."""
    return Pending(shape, dtype, lambda: device.cupy().empty(shape, dtype))


def upload(host: np.ndarray) -> Pending:
    """A host array (positions, a block table) copied to the GPU once the call is
    checked; the checks read ``host``."""
    return Pending(host.shape, host.dtype, lambda: device.cupy().asarray(host), host)


def made(v):
    """``v``, or the array a Pending stands for (made on first use)."""
    return v.made() if isinstance(v, Pending) else v
