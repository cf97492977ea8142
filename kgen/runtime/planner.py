"""The plan a decode kernel gets on the current device when the caller gives none
(kgen.runtime.plan.default_plan), and a split prefill's key splits
(kgen.runtime.plan.prefill_splits), over the device's multiprocessors and the generated
kernels' registers."""

from __future__ import annotations

from kgen.ir.geometry import block_threads, flash_shared_bytes
from kgen.ir.kernel import Kernel
from kgen.runtime.device import multiprocessors
from kgen.runtime.options import given_plan
from kgen.runtime.package import ensure_kgen_kernels, generated
from kgen.runtime.plan import (
    default_plan,
    family_registers,
    plan_registers,
    plan_shared_bytes,
    prefill_splits,
    split_family_registers,
    split_registers,
)

# family_registers (split_family_registers) of the generated kernels, per generated
# package (its root).
_family_registers: dict[str, dict[tuple, int]] = {}
_split_registers: dict[str, dict[tuple, int]] = {}


def kernel_plan(k: Kernel, head_dim: int, n_head_kv: int, kps=None, splits_cap=None,
                who: str = "KVCache", batch: int = 1) -> tuple[int, int]:
    """(kps, splits_cap) for decoding ``batch`` sequences in one launch with ``k``: the
    given values, checked (positive ints), the missing ones from default_plan on the
    current device (asked only then)."""
    kps, splits_cap = given_plan(kps, splits_cap, who)
    if kps is not None and splits_cap is not None:
        return kps, splits_cap
    ensure_kgen_kernels()
    import kgen_kernels

    root = str(kgen_kernels.ROOT)
    if root not in _family_registers:  # once per generated package: every kernel walked
        _family_registers[root] = family_registers(x for x, _ in generated())
    dk, dc = default_plan(multiprocessors(), n_head_kv, block_threads(k, head_dim),
                          plan_registers(k, _family_registers[root]),
                          plan_shared_bytes(k, head_dim), k.schedule, batch)
    return (dk if kps is None else kps), (dc if splits_cap is None else splits_cap)


def split_plan(k: Kernel, head_dim: int, groups: int, blocks: int) -> int:
    """Key splits for a prefill of ``blocks`` blocks with the split kernel ``k`` on the
    current device (kgen.runtime.plan.prefill_splits), weighing the most registers of
    its split-plan family, so its dense and paged forms, and its forms with and without
    the options, split alike (the same bits). No blocks (no rows): 1, and the launch's
    own contracts refuse what needs refusing."""
    if blocks < 1:
        return 1
    import kgen_kernels

    root = str(kgen_kernels.ROOT)
    if root not in _split_registers:
        _split_registers[root] = split_family_registers(x for x, _ in generated())
    return prefill_splits(multiprocessors(), blocks, block_threads(k, head_dim),
                          split_registers(k, _split_registers[root]),
                          flash_shared_bytes(k, groups, head_dim))
