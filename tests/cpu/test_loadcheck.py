"""Which image of a generated fatbin loads on which GPU and driver, decided without
a GPU (kgen.runtime.loadcheck), the fatbin reader it stands on, and the launcher
path that asks it before CuPy loads anything."""

from __future__ import annotations

import struct

import pytest

from kgen.runtime import launch, loadcheck
from kgen.runtime.loadcheck import Device, Image, UnloadableError, decide
from kgen.testing.built import BUILT, needs_build
from kgen.toolchain import fatbin

FATBINS = sorted(BUILT.fatbin(n) for n in BUILT.kernels) if BUILT else []

SASS37 = Image("sass", (3, 7))
PTX37 = Image("ptx", (3, 7), (7, 8))
OFFER = (SASS37, PTX37)  # what every generated fatbin holds (checked below)

K80 = "Tesla K80"
H200 = "NVIDIA H200"


@needs_build
def test_every_generated_fatbin_offers_sm37_sass_and_the_kernels_ptx():
    assert len(FATBINS) == len(BUILT.kernels)
    for fb in FATBINS:
        assert loadcheck.images(fb) == OFFER, fb.name
        (ptx_image,) = [e for e in fatbin.entries(fb.read_bytes()) if e.kind == "ptx"]
        assert ptx_image.version == (7, 8), fb.name


def test_a_ptx_file_offers_its_isa(tmp_path):
    ptx = tmp_path / "k.ptx"
    ptx.write_text("//\n.version 7.8\n.target sm_37\n.address_size 64\n")
    assert fatbin.ptx_isa(ptx.read_text()) == (7, 8)
    assert loadcheck.images(ptx) == (PTX37,)


def test_k80_on_r470_loads_the_sass():
    d = decide(OFFER, Device((3, 7), (11, 4), K80, "470.256.02"))
    assert d.ok and d.image == SASS37
    assert "runs natively on compute 3.7" in d.reason
    assert "CUDA 11.4 driver loads CUDA 11.8-built cubins" in d.reason
    (rejected,) = d.rejected
    assert rejected == (PTX37, "its PTX (ISA 7.8) needs a CUDA 11.8 (R520+) driver; this "
                               "host's is CUDA 11.4")


@pytest.mark.parametrize("driver", [(11, 5), (11, 8), (12, 2), (13, 0)])
def test_k80_on_a_driver_newer_than_r470_is_reported_as_unsupported(driver):
    dev = Device((3, 7), driver, K80)
    d = decide(OFFER, dev)
    assert not d.ok
    assert "Kepler" in d.reason and "R470" in d.reason
    assert f"this host's driver is CUDA {driver[0]}.{driver[1]}" in d.reason
    msg = loadcheck.message("attn_prefill.fatbin", OFFER, d)
    assert msg.startswith(f"cannot load attn_prefill.fatbin on Tesla K80 (compute 3.7, CUDA "
                          f"{driver[0]}.{driver[1]}): ")
    assert "install the R470 driver (CUDA 11.4)" in msg and "kgen[cuda11]" in msg
    assert "sm_37 SASS then loads natively" in msg


def test_h200_on_r580_jit_compiles_the_ptx():
    d = decide(OFFER, Device((9, 0), (13, 0), H200, "580.159.04"))
    assert d.ok and d.image == PTX37
    assert d.reason == ("its compute_37 PTX (ISA 7.8) is JIT-compiled for compute 9.0 by the "
                        "CUDA 13.0 driver (ISA 7.8 needs CUDA 11.8 or newer)")
    assert d.rejected == ((SASS37, "its sm_37 SASS runs only on compute 3.7 GPUs"),)


def test_a_new_gpu_on_an_old_driver_is_told_which_driver_the_ptx_needs():
    d = decide(OFFER, Device((9, 0), (11, 4), H200))
    assert not d.ok
    msg = loadcheck.message("attn_decode.fatbin", OFFER, d)
    assert "sm_37 SASS runs only on compute 3.7 GPUs" in msg
    assert "its PTX (ISA 7.8) needs a CUDA 11.8 (R520+) driver; this host's is CUDA 11.4" in msg
    assert "install an NVIDIA driver of CUDA 11.8 (R520+) or newer" in msg


def test_a_gpu_older_than_compute_37_can_load_nothing():
    d = decide(OFFER, Device((3, 5), (11, 4), "Tesla K40"))
    assert not d.ok
    assert "compute_37 PTX (ISA 7.8) needs a GPU of compute 3.7 or newer" in d.reason
    assert "a compute 3.5 GPU can run none of them" in loadcheck.advice(OFFER, d.device)


def test_sass_needs_a_cuda_11_driver_and_ptx_is_the_fallback_on_a_k80():
    old = decide(OFFER, Device((3, 7), (10, 2), K80))
    assert not old.ok and "needs a driver of CUDA 11.0 (R450+) or newer" in old.reason
    only_ptx = decide((PTX37,), Device((3, 7), (11, 4), K80))
    assert not only_ptx.ok  # ISA 7.8 on an 11.4 driver: the cubin is what makes a K80 work
    ptx74 = Image("ptx", (3, 7), (7, 4))
    assert decide((ptx74,), Device((3, 7), (11, 4), K80)).image == ptx74


def test_the_isa_table_maps_to_the_cuda_release_that_introduced_it():
    assert loadcheck.PTX_ISA_CUDA[(7, 8)] == (11, 8)
    assert loadcheck.PTX_ISA_CUDA[(7, 4)] == (11, 4)
    assert loadcheck.PTX_ISA_CUDA[(7, 0)] == (11, 0)
    assert loadcheck.cuda_version(11040) == (11, 4) and loadcheck.cuda_version(13000) == (13, 0)
    unknown = Image("ptx", (3, 7), (99, 0))
    assert "does not know" in decide((unknown,), Device((9, 0), (13, 0))).reason


@needs_build
def test_require_raises_a_value_error_naming_the_file(tmp_path):
    fb = FATBINS[0]
    assert loadcheck.require(fb, Device((3, 7), (11, 4), K80)).image == SASS37
    with pytest.raises(ValueError, match=rf"cannot load {fb.name} on Tesla K80"):
        loadcheck.require(fb, Device((3, 7), (12, 4), K80))


@needs_build
def test_bad_fatbins_are_a_clear_error(tmp_path):
    good = FATBINS[0].read_bytes()
    with pytest.raises(fatbin.FatbinError, match="not a fatbin"):
        fatbin.entries(b"\x7fELF" + bytes(60))
    with pytest.raises(fatbin.FatbinError, match="truncated"):
        fatbin.entries(good[:-10])
    with pytest.raises(fatbin.FatbinError, match="empty"):
        fatbin.entries(struct.pack("<IHHQ", fatbin.MAGIC, 1, 16, 0))
    with pytest.raises(fatbin.FatbinError, match=r"\.version"):
        fatbin.ptx_isa(".target sm_37\n")


# -- the launcher asks before CuPy loads ----------------------------------------------


class FakeCupy:
    """Just what kgen.runtime.launch.module asks of CuPy; RawModule records loads."""

    def __init__(self, cc: tuple[int, int], driver: int, name: str):
        self.loaded: list[str] = []
        fake = self

        class Runtime:
            @staticmethod
            def getDevice():
                return 0

            @staticmethod
            def getDeviceProperties(i):
                return {"name": name.encode(), "major": cc[0], "minor": cc[1]}

            @staticmethod
            def driverGetVersion():
                return driver

        class Cuda:
            runtime = Runtime

        self.cuda = Cuda

        def raw_module(path):
            fake.loaded.append(path)
            return object()

        self.RawModule = raw_module


@pytest.fixture
def fake_cupy(monkeypatch):
    def make(cc, driver, name):
        cp = FakeCupy(cc, driver, name)
        monkeypatch.setattr(launch, "_cupy", lambda: cp)
        monkeypatch.setattr(launch, "_modules", {})
        return cp
    return make


@needs_build
def test_module_loads_the_fatbin_when_an_image_fits(fake_cupy):
    cp = fake_cupy((9, 0), 13000, H200)
    launch.module(FATBINS[0])
    launch.module(FATBINS[0])  # once per module and device
    assert cp.loaded == [str(FATBINS[0])]


@needs_build
def test_module_refuses_before_the_driver_sees_the_fatbin(fake_cupy):
    cp = fake_cupy((3, 7), 12020, K80)
    with pytest.raises(UnloadableError, match="Kepler"):
        launch.module(FATBINS[0])
    assert cp.loaded == []


@needs_build
def test_generated_launchers_load_their_kernels_fatbin():
    import kgen_kernels

    for name, mod in kgen_kernels.MODULES.items():
        assert set(mod.FATBINS) == set(mod.KERNELS) == {e.name for e in BUILT.modules[name]}
        for k, path in mod.FATBINS.items():
            assert path == BUILT.fatbin(k) and path.is_file() and path.stem == k
            assert getattr(mod, k).fatbin is path
