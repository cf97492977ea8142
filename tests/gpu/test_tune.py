"""`kgen tune` on the GPU: candidates are checked before they are timed, the
choice is stored per device and driver, and a new KVCache picks it up."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.runtime.planner import kernel_plan
from kgen.testing import rng

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_store():
    """Each test reads its own store: nothing loaded before it, or kept after."""
    from kgen.runtime import tuned

    tuned._loaded.clear()
    yield
    tuned._loaded.clear()


def test_a_tuned_plan_is_stored_and_used(tmp_path, monkeypatch):
    import cupy as cp

    from kgen.runtime import tuned
    from kgen.runtime.kv import KVCache
    from kgen.tune import search as tune

    monkeypatch.setenv("KGEN_TUNE_DIR", str(tmp_path))
    path = tune.main(["f32"], [128], [2], [2048], say=lambda *_: None, prefill_rows=())
    device, driver = tuned.current_device()
    stored = tuned.load(device, driver)[tuned.shape_key("f32", 128, 2, 2048)]
    assert stored.source_sha256 == tuned.module_sha(stored.kernel) and path.is_file()

    g, seed = rng()
    hk, hd, n = 2, 128, 1500
    cache = KVCache(hk, hd, 2048, kv="f32")
    host = ref.HostCache.empty("f32", hk, 2048, hd)
    kn, vn = g.standard_normal((n, hk, hd), np.float32), g.standard_normal((n, hk, hd),
                                                                             np.float32)
    cache.append(cp.asarray(kn), cp.asarray(vn), pos0=0)
    ref.append(kn, vn, host, 0)
    q = g.standard_normal((2 * hk, hd), np.float32)
    k1, v1 = g.standard_normal((1, hk, hd), np.float32), g.standard_normal((1, hk, hd),
                                                                         np.float32)
    out = cache.decode(cp.asarray(q), cp.asarray(k1), cp.asarray(v1), pos=n).get()
    assert cache.last_plan == (stored.kps, stored.splits_cap, "tuned")
    assert cache.kernels.get("decode", 2)[0].name == stored.kernel
    ref.append(k1, v1, host, n)
    kr, vr = ref.read_kv_rows(host, n)
    kd = cache.kernels.get("decode", 2)[0]
    want = ref.decode_attention(q, kr, vr, 2, n + 1, stored.kps, stored.splits_cap, 0, 0,
                                1 / math.sqrt(hd), tile=kd.tile_keys)
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-5, err_msg=f"seed={seed}")
    # A choice whose kernel source changed is stale and ignored.
    tuned._loaded.clear()
    monkeypatch.setattr(tuned, "module_sha", lambda name: "changed")
    fresh = KVCache(hk, hd, 2048, kv="f32")
    fresh.append(cp.asarray(kn), cp.asarray(vn), pos0=0)
    fresh.decode(cp.asarray(q), cp.asarray(k1), cp.asarray(v1), pos=n)
    assert fresh.last_plan[2] == "default"  # the plan derived from this device
    assert fresh.last_plan[:2] == kernel_plan(fresh.kernels.get("decode", 2)[0], hd, hk)


def test_a_tuned_prefill_is_stored_and_used(tmp_path, monkeypatch):
    """The prefill choice per (kv, head_dim, groups) is stored, a new KVCache.prefill
    runs it (its output checked against the reference), and a named variant still
    wins over it."""
    import cupy as cp

    from kgen.runtime import tuned
    from kgen.runtime.kv import KVCache
    from kgen.tune import search as tune

    monkeypatch.setenv("KGEN_TUNE_DIR", str(tmp_path))
    tune.main(["f32"], [128], [4], [1024], say=lambda *_: None, prefill_rows=[256])
    device, driver = tuned.current_device()
    stored = tuned.load(device, driver)[tuned.prefill_key("f32", 128, 4, 256)]
    assert stored.source_sha256 == tuned.module_sha(stored.kernel)

    g, seed = rng()
    hk, hd, n = 2, 128, 200  # a batch in the tuned bucket (129..256 rows)
    cache = KVCache(hk, hd, 512, kv="f32")
    q = g.standard_normal((n, 4 * hk, hd), np.float32)
    kn, vn = g.standard_normal((n, hk, hd), np.float32), g.standard_normal((n, hk, hd),
                                                                             np.float32)
    out = cache.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0).get()
    assert cache.last_prefill == stored.kernel
    kp = next(k for k, _ in tune_candidates(hd, 4) if k.name == stored.kernel)
    host = ref.HostCache.empty("f32", hk, 512, hd)
    ref.append(kn, vn, host, 0)
    want = ref.prefill_attention_cache(q, host, 4, 0, 0, 0, 0, 0, 1 / math.sqrt(hd),
                                       tile=kp.tile_keys)
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-5, err_msg=f"seed={seed}")
    others = [k for k, _ in tune_candidates(hd, 4) if k.name != stored.kernel]
    if others:
        named = KVCache(hk, hd, 512, kv="f32", variants={"prefill": others[0].name})
        named.prefill(cp.asarray(q[:8]), cp.asarray(kn[:8]), cp.asarray(vn[:8]), pos0=0)
        assert named.last_prefill == others[0].name


def tune_candidates(hd: int, groups: int):
    from kgen.ir.axes import Mode, Op, Position
    from kgen.runtime.bind import shape_refusal
    from kgen.runtime.select import Role, generated, options

    role = Role(Op.FLASH, Position.HOST, Mode.PREFILL, "f32")
    return [(k, f) for k, f in generated() if role.matches(k) and not options(k)
            and shape_refusal(k, hd, groups) is None]
