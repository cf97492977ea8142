"""Rebuild a kernel's IR from the axes a generated module records, with the resources
the build recorded for it: what its launch contracts read."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kgen.ir.axes import KEYS
from kgen.ir.kernel import Kernel


@dataclass(frozen=True)
class Built(Kernel):
    """A built kernel as the runtime knows it: its IR, rebuilt from the manifest's
    axes, and the registers ptxas gave one of its threads (the manifest's
    ``resources``), which bound the block it can launch on the target (the launch
    contract ``block registers``, kgen.runtime.bind). The spec's kernels (the
    compiler's IR, before ptxas ran) carry none: the build's limits stage weighs
    their blocks against ptxas's report instead."""

    registers: int | None = None


def kernel(name: str, axes: dict, resources: dict | None = None) -> Built:
    """``axes`` holds every key of ``kgen.ir.axes.KEYS`` as a plain value;
    ``resources`` is the manifest entry's ptxas report (``registers``, ...)."""
    values = {}
    for key, spec in KEYS.items():
        raw = axes[key]
        values[key] = spec.type(raw) if raw is not None else None
    known = {f.name for f in fields(Kernel)}
    regs = (resources or {}).get("registers")
    return Built(name=name, **{k: v for k, v in values.items() if k in known},
                 registers=None if regs is None else int(regs))


def registers(k: Kernel) -> int | None:
    """The registers a thread of ``k`` uses, where the build recorded them."""
    return k.registers if isinstance(k, Built) else None


def axes_of(k: Kernel) -> dict:
    """The inverse: plain values, for emitting into a generated module."""
    return {key: getattr(getattr(k, key), "value", getattr(k, key)) for key in KEYS}


def forms_key(k: Kernel) -> tuple:
    """``k``'s axes but its position (and doc and module): equal for the forms of one
    arithmetic (host, device, slots, paged), which are siblings and share a plan."""
    axes = axes_of(k)
    for key in ("position", "doc", "module"):
        axes.pop(key)
    return tuple(sorted(axes.items()))
