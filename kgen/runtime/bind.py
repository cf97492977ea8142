"""Bind a kernel's arguments: contracts, geometry and the argument tuple.

Pure Python over anything array-like (``shape``, ``dtype``, ``flags``), so the
same checks run on CuPy arrays before a launch and on NumPy arrays in tests
without a GPU. Derived kernel arguments (kv_groups, head_dim, max_seq,
n_head_kv, total) come from the array shapes; the caller passes the rest.

Each op's binder is its op object's (kgen.ops: ``OpDef.bind`` and
``OpDef.check_launch_shape``), over the contracts several ops share
(kgen.runtime.checks).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kgen.ir.kernel import Kernel
from kgen.ir.target import TARGET
from kgen.ops import get, params
from kgen.runtime.checks import QZ_BLOCK, REGISTERS
from kgen.runtime.contracts import Checker, ContractError

__all__ = ["QZ_BLOCK", "REGISTERS", "Launch", "bind", "reads_device", "shape_error",
           "shape_refusal"]


class Launch(NamedTuple):
    """A bound launch. A named tuple, not a dataclass: a launch replaying a
    remembered binding makes one per call, and this is the cheapest to make."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple  # in the kernel's parameter order: arrays, then typed scalars
    names: tuple[str, ...]

    def arg(self, name: str):
        return self.args[self.names.index(name)]


def reads_device(k: Kernel, a: dict) -> bool:
    """Whether binding ``a`` reads device memory: the positions, block tables, seq
    lens, slot maps and other index arrays a binder whose op reads indices from the
    device (``OpDef.validates_pos``) copies back and checks unless ``validate_pos`` is
    false. Such a binding holds for those contents only; it is never replayed."""
    return get(k.op).validates_pos(k) and bool(a.get("validate_pos", True))


def _order(k: Kernel, values: dict) -> tuple[tuple, tuple[str, ...]]:
    """The arguments in ``k``'s parameter order, scalars as the kernel's C types: an
    integer past a C int (a shape no binder bounds, say 2**31 q heads) is a ContractError
    naming the parameter, not NumPy's OverflowError."""
    out, names = [], []
    for p in params(k):
        v = values[p.name]
        if not p.is_pointer:
            try:
                v = np.float32(v) if p.ctype == "float" else np.int32(v)
            except OverflowError:
                raise ContractError(k.name, "int range", f"{p.name} = {v} is outside a C "
                                    "int") from None
        out.append(v)
        names.append(p.name)
    return tuple(out), tuple(names)


def _grid(c: Checker, grid: tuple[int, int, int]) -> tuple[int, int, int]:
    c.require(1 <= grid[0] <= TARGET.grid_x_max, "grid", lambda: f"grid.x = {grid[0]} out of range")
    c.require(grid[1] <= TARGET.grid_yz_max and grid[2] <= TARGET.grid_yz_max, "grid",
              lambda: f"grid {grid} exceeds {TARGET.grid_yz_max} in y or z")
    return grid


def bind(k: Kernel, a: dict) -> Launch:
    """Check ``a`` (argument name -> value) against ``k``'s contracts (its op's binder,
    kgen.ops.OpDef.bind); build the Launch."""
    expected = {p.name for p in params(k)}
    c = Checker(k.name)
    grid, block, smem, values = get(k.op).bind(k, c, dict(a))
    missing = expected - set(values)
    assert not missing, f"binder for {k.name} left {missing} unset"
    for p in params(k):  # every array on its alignment contract (its widest access)
        if p.is_pointer:
            c.aligned(p.name, values[p.name], p.align)
    args, names = _order(k, values)
    return Launch(k.name, _grid(c, grid), block, smem, args, names)


def shape_error(k: Kernel, head_dim: int, groups: int = 1) -> ContractError | None:
    """The contract ``k`` breaks at ``head_dim`` with ``groups`` q heads per KV head,
    or None: the launch contracts that depend on shapes alone (block size and
    registers, row format, tiles, shared memory), for choosing a kernel before any
    array exists."""
    return get(k.op).shape_error(k, head_dim, groups)


def shape_refusal(k: Kernel, head_dim: int, groups: int = 1) -> str | None:
    """Why ``k`` cannot run ``head_dim`` with ``groups`` q heads per KV head (the
    contract's message, :func:`shape_error`), or None."""
    exc = shape_error(k, head_dim, groups)
    return None if exc is None else str(exc)
