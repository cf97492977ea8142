"""Kernel parameter lists, derived from a kernel's axes.

The templates render these and the Python launchers bind to them, so the two
cannot disagree about a kernel's arguments. Each op object lists its kernels'
(``OpDef.params``) from the helpers here.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")

    @property
    def decl(self) -> str:
        sep = "" if self.is_pointer else " "
        return f"{self.ctype}{sep}{self.name}"


def fixed(ctype: str, *names: str) -> list[Param]:
    """Parameters of a fixed C type (an array's elements in ``ELEMENT_DTYPES``)."""
    element = ctype.removeprefix("const ").removesuffix("*").rstrip()
    dtype = ELEMENT_DTYPES[element] if ctype.endswith("*") else None
    return [Param(n, ctype, dtype) for n in names]


def cache_arrays(k: Kernel, const: str) -> list[Param]:
    """The K and V cache arrays: rows of each role's format."""
    return [Param(f"{r}_cache", f"{const}{k.pair.of(r).ctype} *", k.pair.of(r).dtype)
            for r in ROLES]


def elems(dtype, const: str, *names: str) -> list[Param]:
    """Arrays of an op's element type (``in_dtype`` / ``out_dtype``: a plain-element
    format's C and NumPy types)."""
    fmt = dtype.fmt
    return [Param(n, f"{const}{fmt.ctype} *", fmt.dtype) for n in names]


def position_params(k: Kernel, host: list[Param]) -> list[Param]:
    """``host`` where the host passes the position (position = host), else the device's
    ``pos`` array."""
    if k.position is Position.HOST:
        return host
    return fixed("const int *", "pos")
