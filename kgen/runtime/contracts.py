"""Kernel contracts as checks that raise before anything reaches the GPU."""

from __future__ import annotations

import numpy as np


class ContractError(ValueError):
    """A launch would break a kernel contract; ``contract`` names which one, ``message``
    says how."""

    def __init__(self, kernel: str, contract: str, message: str):
        self.kernel = kernel
        self.contract = contract
        self.message = message
        super().__init__(f"{kernel}: {message} [contract: {contract}]")


ALIGN_MAX = 16  # bytes: the widest alignment any kernel asks of an array (a float4);
#                 an address a multiple of this meets every alignment contract


def address(a) -> int | None:
    """The device address an array starts at, where it tells one (``data.ptr``)."""
    ptr = getattr(getattr(a, "data", None), "ptr", None)
    return None if ptr is None else int(ptr)


class Checker:
    """Contract checks for one kernel's launch."""

    def __init__(self, kernel: str):
        self.kernel = kernel

    def require(self, ok: bool, contract: str, message) -> None:
        """``message``: the text, or a callable making it (formatted only on failure:
        a launch checks dozens of contracts, and formatting them all costs more than
        the launch)."""
        if not ok:
            raise ContractError(self.kernel, contract, message() if callable(message)
                                else message)

    def array(self, name: str, a, dtype, ndim: int | None = None) -> None:
        """dtype, C-contiguity and rank of one array argument."""
        self.require(hasattr(a, "shape") and hasattr(a, "dtype"), "array",
                     lambda: f"{name} must be an array, not {type(a).__name__}")
        self.require(a.dtype == dtype, "dtype",
                     lambda: f"{name} must be {np.dtype(dtype).name}, not {a.dtype}")
        if ndim is not None:
            self.require(a.ndim == ndim, "shape",
                         lambda: f"{name} must have {ndim} dimensions, not shape "
                         f"{tuple(a.shape)}")
        flags = getattr(a, "flags", None)
        self.require(flags is None or bool(flags.c_contiguous), "contiguous",
                     lambda: f"{name} must be C-contiguous")

    def aligned(self, name: str, a, align: int) -> None:
        """An array the kernel reads or writes ``align`` bytes an access (its alignment
        contract, kgen.ir.signature.Param.align) starts on an ``align``-byte boundary;
        checked where the array tells its address (``data.ptr``: a CuPy array; host
        arrays and arrays still to be made have none)."""
        ptr = address(a)
        self.require(ptr is None or ptr % align == 0, "alignment",
                     lambda: f"{name} must start on a {align}-byte boundary (address "
                     f"{ptr:#x})")

    def shape(self, name: str, a, expected: tuple[int, ...]) -> None:
        self.require(tuple(a.shape) == tuple(expected), "shape",
                     lambda: f"{name} has shape {tuple(a.shape)}; expected {tuple(expected)}")

    def integer(self, name: str, v, lo: int | None = None, hi: int | None = None,
                contract: str = "range") -> int:
        self.require(isinstance(v, int | np.integer) and not isinstance(v, bool), "type",
                     lambda: f"{name} must be an integer, not {v!r}")
        v = int(v)
        if lo is not None:
            self.require(v >= lo, contract, lambda: f"{name} = {v} is below {lo}")
        if hi is not None:
            self.require(v <= hi, contract, lambda: f"{name} = {v} exceeds {hi}")
        return v
