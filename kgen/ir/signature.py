"""Kernel parameter lists, derived from a kernel's axes.

The templates render these and the Python launchers bind to them, so the two
cannot disagree about a kernel's arguments. Each op object lists its kernels'
(``OpDef.params``) from the helpers here.

A pointer parameter also carries its alignment contract (``Param.align``): the bytes its
address must be a multiple of, those of the widest access the kernel's template makes
through it. That is its element unless the op says wider where it decides the access
(a format's quad reader or append writer, kgen.ir.geometry's vector copies);
tests/cpu/test_alignment.py reads every kernel's generated source for the widest access
through each parameter and holds the contracts to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kgen.formats.base import ROLES
from kgen.ir.axes import Position
from kgen.ir.kernel import Kernel

# NumPy dtypes of the element types of the arrays every kernel of an op takes; a KV
# cache array's elements are its format's (``KvFormat.ctype``, ``KvFormat.dtype``).
ELEMENT_DTYPES = {"float": "float32", "__half": "float16", "int": "int32",
                  "long long": "int64"}


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # e.g. "const float *", "int"
    dtype: str | None = None  # a pointer's NumPy element dtype (what the launcher checks)
    align: int = 0  # a pointer's alignment contract in bytes: its address a multiple of
    #                 this (its widest access); 0 given: its element's. 0 for a scalar.

    def __post_init__(self):
        if self.is_pointer:
            element = np.dtype(self.dtype).itemsize
            align = self.align or element
            if align % element or align & (align - 1):
                raise ValueError(f"{self.name}: align = {align} is no power-of-two multiple "
                                 f"of its {element}-byte element")
            object.__setattr__(self, "align", align)
        elif self.align:
            raise ValueError(f"{self.name}: a scalar has no alignment")

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")

    @property
    def decl(self) -> str:
        sep = "" if self.is_pointer else " "
        return f"{self.ctype}{sep}{self.name}"


def fixed(ctype: str, *names: str) -> list[Param]:
    """Parameters of a fixed C type (an array's elements in ``ELEMENT_DTYPES``; its
    alignment its element's)."""
    element = ctype.removeprefix("const ").removesuffix("*").rstrip()
    dtype = ELEMENT_DTYPES[element] if ctype.endswith("*") else None
    return [Param(n, ctype, dtype) for n in names]


def cache_arrays(k: Kernel, const: str, align: Callable[[str], int]) -> list[Param]:
    """The K and V cache arrays: rows of each role's format, ``align(role)`` bytes
    aligned (the widest access of the op's readers or writer of that role's rows)."""
    return [Param(f"{r}_cache", f"{const}{k.pair.of(r).ctype} *", k.pair.of(r).dtype,
                  align(r)) for r in ROLES]


def elems(dtype, const: str, *names: str, align: int = 0) -> list[Param]:
    """Arrays of an op's element type (``in_dtype`` / ``out_dtype``: a plain-element
    format's C and NumPy types), ``align`` bytes aligned (0: the element's)."""
    fmt = dtype.fmt
    return [Param(n, f"{const}{fmt.ctype} *", fmt.dtype, align) for n in names]


def position_params(k: Kernel, host: list[Param]) -> list[Param]:
    """``host`` where the host passes the position (position = host), else the device's
    ``pos`` array."""
    if k.position is Position.HOST:
        return host
    return fixed("const int *", "pos")
