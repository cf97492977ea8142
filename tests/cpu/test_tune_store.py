"""The `kgen tune` store without a GPU: choices are read per device and driver, an
entry whose kernel source changed is dropped, decode and prefill classes bucket
their lengths, and no GPU means nothing tuned applies."""

from __future__ import annotations

import pytest

from kgen.runtime import tuned


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("KGEN_TUNE_DIR", str(tmp_path))
    monkeypatch.setattr(tuned, "current_device", lambda: ("Some GPU", 12080))
    monkeypatch.setattr(tuned, "module_sha", lambda name: "sha-" + name)
    tuned._loaded.clear()
    yield
    tuned._loaded.clear()


def test_decode_and_prefill_choices_by_class(store):
    fresh = tuned.Choice("k_decode", "sha-k_decode", 64, 64, 40.0)
    stale = tuned.Choice("k_old", "sha-before", 128, 16, 50.0)
    pre = tuned.Choice("k_prefill", "sha-k_prefill", 0, 0, 900.0)
    tuned.save("Some GPU", 12080, {
        tuned.shape_key("f32", 256, 8, 4096): fresh,
        tuned.shape_key("f32", 256, 8, 32768): stale,
        tuned.prefill_key("f32", 256, 8, 128): pre,
    })
    assert tuned.tuned("f32", 256, 8, 3000) == fresh        # same bucket (4096)
    assert tuned.tuned("f32", 256, 8, 5000) is None         # bucket 8192: nothing stored
    assert tuned.tuned("f32", 256, 8, 32768) is None        # stale: its source changed
    assert tuned.tuned_prefill("f32", 256, 8, 100) == pre   # rows bucket 128
    assert tuned.tuned_prefill("f32", 256, 8, 200) is None  # rows bucket 256
    assert tuned.tuned_prefill("f32", 128, 8, 100) is None


def test_no_gpu_means_nothing_tuned(store, monkeypatch):
    def no_gpu():
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(tuned, "current_device", no_gpu)
    assert tuned.tuned("f32", 256, 8, 4096) is None
    assert tuned.tuned_prefill("f32", 256, 8, 128) is None


def test_buckets():
    assert [tuned.bucket(n) for n in (1, 1024, 1025, 4096, 4097)] == [1024, 1024, 2048, 4096,
                                                                      8192]
    assert [tuned.rows_bucket(n) for n in (1, 128, 129, 2048)] == [128, 128, 256, 2048]
