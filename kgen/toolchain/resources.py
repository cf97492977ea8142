"""Per-kernel resources from ptxas's ``-v`` report."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

_COMPILING = re.compile(r"Compiling entry function '(\w+)'")
_PROPS = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_USED = re.compile(r"Used (\d+) registers(?:, (\d+) bytes smem)?")


@dataclass(frozen=True)
class Resources:
    registers: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    static_smem: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def parse(ptxas_log: str) -> dict[str, Resources]:
    """Map kernel name -> Resources, from ``ptxas -v`` output."""
    out: dict[str, Resources] = {}
    name = None
    props = (0, 0, 0)
    for line in ptxas_log.splitlines():
        m = _COMPILING.search(line)
        if m:
            name, props = m.group(1), (0, 0, 0)
            continue
        m = _PROPS.search(line)
        if m and name:
            props = tuple(int(x) for x in m.groups())
            continue
        m = _USED.search(line)
        if m and name:
            out[name] = Resources(int(m.group(1)), *props, int(m.group(2) or 0))
            name = None
    return out
