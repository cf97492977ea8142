"""Read a cubin's per-kernel code sections (ELF64, little-endian).

A kernel's encoded instruction stream, control words included, is exactly the
bytes of its ``.text.<kernel>`` section: comparing those bytes is comparing
the SASS, encodings included, without running a disassembler.
"""

from __future__ import annotations

import struct

TEXT_PREFIX = ".text."


class ElfError(ValueError):
    pass


def sections(blob: bytes) -> dict[str, bytes]:
    """Section name -> contents of an ELF64 little-endian file."""
    if blob[:4] != b"\x7fELF" or blob[4] != 2 or blob[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = []
    for i in range(shnum):
        name, _type, _flags, _addr, off, size = struct.unpack_from(
            "<IIQQQQ", blob, shoff + i * shentsize)
        headers.append((name, _type, off, size))
    _, _, str_off, str_size = headers[shstrndx]
    strtab = blob[str_off:str_off + str_size]
    out = {}
    for name, typ, off, size in headers:
        end = strtab.index(b"\0", name)
        label = strtab[name:end].decode()
        out[label] = b"" if typ == 8 else blob[off:off + size]  # SHT_NOBITS holds no bytes
    return out


def kernel_code(blob: bytes) -> dict[str, bytes]:
    """Kernel name -> its encoded instruction stream."""
    return {n[len(TEXT_PREFIX):]: b for n, b in sections(blob).items()
            if n.startswith(TEXT_PREFIX)}
