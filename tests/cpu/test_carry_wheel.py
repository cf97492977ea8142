"""tests/gpu/carry_wheel.py: a wheel packed for a size-capped copy unpacks to a wheel with
the same members, in the same order, with the same bytes and times (so the same RECORD),
and what it packs is smaller than the deflated wheel when members repeat one another."""

from __future__ import annotations

import importlib.util
import os
import zipfile
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "carry_wheel.py"


def _module():
    spec = importlib.util.spec_from_file_location("carry_wheel", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_packed_wheel_unpacks_to_the_same_members(tmp_path, monkeypatch):
    carry = _module()
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    blob = rng.integers(0, 256, 20000, dtype=np.uint8).tobytes()  # incompressible alone
    wheel = tmp_path / "kgen-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for i in range(8):  # members that repeat one another, as kernels' fatbins do
            info = zipfile.ZipInfo(f"kgen_kernels/kernels/k{i}.fatbin", (1980, 1, 1, 0, 0, 0))
            z.writestr(info, blob[i:] + bytes([i]))
        z.writestr(zipfile.ZipInfo("kgen-0.1.0.dist-info/RECORD", (1980, 1, 1, 0, 0, 0)), "r")
    monkeypatch.chdir(tmp_path)
    packed = carry.pack(wheel)
    assert packed == Path("dist/carry/kgen-0.1.0-py3-none-any.whl.xz")
    assert packed.stat().st_size < wheel.stat().st_size / 2
    back = carry.unpack(packed, tmp_path / "out")
    with zipfile.ZipFile(wheel) as a, zipfile.ZipFile(back) as b:
        assert [(i.filename, i.date_time) for i in a.infolist()] == \
               [(i.filename, i.date_time) for i in b.infolist()]
        assert all(a.read(n) == b.read(n) for n in a.namelist())
    assert carry.main(["unpack"]) == 2
