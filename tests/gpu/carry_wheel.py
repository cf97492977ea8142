"""The wheel `make dist` wrote, packed small for a GPU machine reached through a size-capped
copy, and unpacked there (wheel_venv.sh does it when dist/ holds only the packed form).

A wheel is a zip whose members are deflated one by one; the fatbins and sources of many
kernels repeat one another, which only a solid compressor sees. So `pack` rewrites the
wheel with its members stored (same names, order, times and bytes: the same RECORD) and
xz-compresses that whole file: at 1645 kernels 67.7 MB become 29.2 MB. `unpack` gives a
stored wheel back, which pip installs as it would the deflated one.

    python tests/gpu/carry_wheel.py pack [WHEEL]       # -> dist/carry/<wheel name>.xz
    python tests/gpu/carry_wheel.py unpack PACKED DIR  # -> DIR/<wheel name>
"""

from __future__ import annotations

import glob
import lzma
import shutil
import sys
import zipfile
from pathlib import Path

CARRY = Path("dist") / "carry"


def stored(wheel: Path, out: Path) -> None:
    """``wheel`` rewritten with every member stored, in its order, with its times."""
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            member = zipfile.ZipInfo(info.filename, info.date_time)
            member.external_attr = info.external_attr
            dst.writestr(member, src.read(info), compress_type=zipfile.ZIP_STORED)


def pack(wheel: Path) -> Path:
    CARRY.mkdir(parents=True, exist_ok=True)
    plain = CARRY / wheel.name
    stored(wheel, plain)
    packed = CARRY / (wheel.name + ".xz")
    with plain.open("rb") as f, lzma.open(packed, "wb", preset=6) as out:
        shutil.copyfileobj(f, out, 1 << 20)
    plain.unlink()
    return packed


def unpack(packed: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    wheel = into / packed.name.removesuffix(".xz")
    with lzma.open(packed, "rb") as f, wheel.open("wb") as out:
        shutil.copyfileobj(f, out, 1 << 20)
    zipfile.ZipFile(wheel).testzip()
    return wheel


def main(argv: list[str]) -> int:
    if argv[:1] == ["pack"] and len(argv) <= 2:
        wheels = argv[1:] or sorted(glob.glob("dist/kgen-*.whl"))
        if not wheels:
            print("no dist/kgen-*.whl: run `make dist`", file=sys.stderr)
            return 2
        packed = pack(Path(wheels[0]))
        print(f"wrote {packed} ({packed.stat().st_size} bytes)")
        return 0
    if argv[:1] == ["unpack"] and len(argv) == 3:
        print(unpack(Path(argv[1]), Path(argv[2])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
