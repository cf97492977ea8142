"""The plan a decode kernel gets on the current device when the caller gives none:
kgen.runtime.plan.default_plan over the device's multiprocessors and the generated
kernels' registers."""

from __future__ import annotations

from kgen.ir.geometry import block_threads
from kgen.ir.kernel import Kernel
from kgen.runtime.device import multiprocessors
from kgen.runtime.package import generated
from kgen.runtime.plan import (
    default_plan,
    family_registers,
    given_plan,
    plan_registers,
    plan_shared_bytes,
)

# family_registers of the generated kernels, per generated package (its root).
_family_registers: dict[str, dict[tuple, int]] = {}


def kernel_plan(k: Kernel, head_dim: int, n_head_kv: int, kps=None, splits_cap=None,
                who: str = "KVCache", batch: int = 1) -> tuple[int, int]:
    """(kps, splits_cap) for decoding ``batch`` sequences in one launch with ``k``: the
    given values, checked (positive ints), the missing ones from default_plan on the
    current device (asked only then)."""
    kps, splits_cap = given_plan(kps, splits_cap, who)
    if kps is not None and splits_cap is not None:
        return kps, splits_cap
    pool = generated()
    import kgen_kernels

    root = str(kgen_kernels.ROOT)
    if root not in _family_registers:
        _family_registers[root] = family_registers(x for x, _ in pool)
    dk, dc = default_plan(multiprocessors(), n_head_kv, block_threads(k, head_dim),
                          plan_registers(k, _family_registers[root]),
                          plan_shared_bytes(k, head_dim), k.schedule, batch)
    return (dk if kps is None else kps), (dc if splits_cap is None else splits_cap)
