"""The KV-cache formats, registered by name.

A new format is a module here (its ``FORMAT`` object), a line below, and
``templates/kv/<name>.j2`` (plus ``templates/lib/<name>.cuh.j2`` for helpers).
The spec axis ``kv`` takes exactly these names.
"""

from __future__ import annotations

from enum import StrEnum

from kgen.formats import bf16, f16, f32, fp8_e4m3, q4, q8_0
from kgen.formats.base import KvFormat, Shadow
from kgen.formats.pair import KvPair

# Registration: the one place that lists the formats.
FORMATS: dict[str, KvFormat] = {m.FORMAT.name: m.FORMAT
                                for m in (f32, q4, f16, q8_0, fp8_e4m3, bf16)}


class _FormatName(StrEnum):
    @property
    def fmt(self) -> KvFormat:
        """The format object this spelling names."""
        return FORMATS[self.value]


# The spec axis: an enum of the registered names, so specs, `kgen show` and the
# generated launchers spell a format like any other axis value.
KvFormatName = _FormatName("KvFormatName", [(n.upper(), n) for n in FORMATS])



def pair(kv: str, v_kv: str | None = None) -> KvPair:
    """The pair of registered formats a cache of K rows ``kv`` and V rows ``v_kv``
    (None: ``kv`` too) keeps; a name not registered is a KeyError."""
    return KvPair(FORMATS[kv], FORMATS[v_kv if v_kv is not None else kv])


def as_pair(fmt: KvFormat | KvPair | str) -> KvPair:
    """A format (by object or name) as the pair of one format, or a pair as it is."""
    if isinstance(fmt, KvPair):
        return fmt
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    return KvPair(fmt, fmt)


__all__ = ["FORMATS", "KvFormat", "KvFormatName", "KvPair", "Shadow", "as_pair", "pair"]
