"""Read a CUDA fat binary's table of contents in pure Python: which images it holds
(SASS for an sm, PTX for a compute capability and its ISA version), without a GPU,
a driver or the toolkit.

A fatbin is one or more containers, each a 16-byte header (magic 0xBA55ED50,
version, header size, payload size) followed by entries. Every entry has a header
(kind 1 = PTX, 2 = ELF/SASS; the header and payload sizes; the code version --
for PTX its ISA version, major and minor; the sm; the identifier fatbinary's
``--ident`` wrote; flags, bit 0x2000 = payload compressed) and then its payload.
ELF payloads are never compressed by kgen's flags, so the SASS image is the
cubin's exact bytes.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

MAGIC = 0xBA55ED50
_CONTAINER = struct.Struct("<IHHQ")  # magic, version, header size, payload size
_ENTRY = struct.Struct("<HHIQIIHHIIIQ")  # see Entry; 48 bytes, the rest of a header is padding
KIND_PTX, KIND_ELF = 1, 2
FLAG_COMPRESSED = 0x2000

_PTX_VERSION = re.compile(r"^\s*\.version\s+(\d+)\.(\d+)", re.M)
_PTX_TARGET = re.compile(r"^\s*\.target\s+sm_(\d+)", re.M)


class FatbinError(ValueError):
    """Bytes that are not a fatbin kgen can read."""


@dataclass(frozen=True)
class Entry:
    """One image: ``kind`` "sass" or "ptx"; ``arch`` as an int (37 = sm_37 for SASS,
    compute_37 for PTX); ``version`` the PTX ISA (major, minor) for PTX, the ELF code
    version for SASS; ``payload`` as stored (compressed when ``compressed``)."""

    kind: str
    arch: int
    version: tuple[int, int]
    compressed: bool
    ident: str
    payload: bytes

    @property
    def cc(self) -> tuple[int, int]:
        return divmod(self.arch, 10)

    def __str__(self) -> str:
        if self.kind == "sass":
            return f"sm_{self.arch} SASS"
        return f"compute_{self.arch} PTX (ISA {self.version[0]}.{self.version[1]})"


def entries(data: bytes) -> tuple[Entry, ...]:
    """Every image of every container in ``data``; FatbinError if it is not a fatbin."""
    out: list[Entry] = []
    at = 0
    while at < len(data):
        head = data[at:at + 4]
        if head != struct.pack("<I", MAGIC)[:len(head)]:
            raise FatbinError(f"not a fatbin (bytes {head.hex()} at byte {at})")
        if len(data) - at < _CONTAINER.size:
            raise FatbinError(f"truncated fatbin header at byte {at}")
        _magic, _version, hsize, size = _CONTAINER.unpack_from(data, at)
        end = at + hsize + size
        if end > len(data):
            raise FatbinError(f"truncated fatbin: {len(data)} bytes, the header says {end}")
        e = at + hsize
        while e < end:
            if end - e < _ENTRY.size:
                raise FatbinError(f"truncated entry header at byte {e}")
            (kind, _v, ehsize, psize, _csize, _opts, minor, major, arch, name_at, name_len,
             flags) = _ENTRY.unpack_from(data, e)
            if ehsize < _ENTRY.size or e + ehsize + psize > end:
                raise FatbinError(f"bad entry at byte {e} (header {ehsize}, payload {psize})")
            if kind not in (KIND_PTX, KIND_ELF):
                raise FatbinError(f"unknown image kind {kind} at byte {e}")
            ident = b""
            if name_len and name_at + name_len <= ehsize:
                ident = data[e + name_at:e + name_at + name_len]
            out.append(Entry(
                kind="ptx" if kind == KIND_PTX else "sass", arch=arch, version=(major, minor),
                compressed=bool(flags & FLAG_COMPRESSED),
                ident=ident.split(b"\0", 1)[0].decode("utf-8", "replace"),
                payload=data[e + ehsize:e + ehsize + psize]))
            e += ehsize + psize
        at = end
    if not out:
        raise FatbinError("empty fatbin")
    return tuple(out)


def ptx_isa(text: str) -> tuple[int, int]:
    """The ``.version`` of a PTX text, e.g. (7, 8) for nvcc 11.8's output."""
    m = _PTX_VERSION.search(text)
    if m is None:
        raise FatbinError("PTX without a .version directive")
    return int(m[1]), int(m[2])


def ptx_entry(text: str) -> Entry:
    """A PTX file described as the image a fatbin would hold for it."""
    m = _PTX_TARGET.search(text)
    if m is None:
        raise FatbinError("PTX without a .target sm_XX directive")
    return Entry("ptx", int(m[1]), ptx_isa(text), False, "", text.encode())
