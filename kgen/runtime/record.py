"""Rebuild a kernel's IR from the axes a generated module records."""

from __future__ import annotations

from dataclasses import fields

from kgen.ir.axes import KEYS
from kgen.ir.kernel import Kernel


def kernel(name: str, axes: dict) -> Kernel:
    """``axes`` holds every key of ``kgen.ir.axes.KEYS`` as a plain value."""
    values = {}
    for key, spec in KEYS.items():
        raw = axes[key]
        values[key] = spec.type(raw) if raw is not None else None
    known = {f.name for f in fields(Kernel)}
    return Kernel(name=name, **{k: v for k, v in values.items() if k in known})


def axes_of(k: Kernel) -> dict:
    """The inverse: plain values, for emitting into a generated module."""
    return {key: getattr(getattr(k, key), "value", getattr(k, key)) for key in KEYS}
