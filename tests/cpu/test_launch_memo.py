"""A launch that replays a remembered binding is exactly as checked as one that
binds in full: every contract input (array types, shapes, dtypes, strides,
devices, scalar types and values, device memory that is validated) decides the
hit. CPU only: CuPy is a fake whose arrays are attribute bags and whose kernel
functions record their launches."""

from __future__ import annotations

import numpy as np
import pytest

from kgen.runtime import ContractError, Launch, launch
from kgen.testing.fakecupy import FakeArray, FakeCupy


@pytest.fixture
def gpu(monkeypatch):
    """(fake cupy, launches recorded, bindings made)."""
    cp = FakeCupy().install(monkeypatch)
    binds = []
    real_bind = launch.bind

    def bind(k, a):
        binds.append(k.name)
        return real_bind(k, a)

    monkeypatch.setattr(launch, "bind", bind)
    return cp, cp.launched, binds


def _mods():
    from kgen.runtime.package import ensure_kgen_kernels

    ensure_kgen_kernels()
    import kgen_kernels

    return kgen_kernels


HD, NH, NKV, MS = 256, 2, 1, 64


def _decode_arrays(**over):
    a = dict(q=FakeArray((NH, HD)), k_cache=FakeArray((NKV, MS, HD)),
             v_cache=FakeArray((NKV, MS, HD)), m_out=FakeArray((NH * 2,)),
             l_out=FakeArray((NH * 2,)), acc_out=FakeArray((NH * 2 * HD,)))
    a.update(over)
    return a


PLAN = dict(seq_len=32, n_splits=2, split_len=16)


def _decode(fn, arrays=None, **kw):
    a = arrays or _decode_arrays()
    return fn(a["q"], a["k_cache"], a["v_cache"], a["m_out"], a["l_out"], a["acc_out"],
              **{**PLAN, **kw})


def test_a_hit_replays_the_binding_with_the_calls_arrays(gpu):
    _, launched, binds = gpu
    fn = _mods().attn_decode.fc_attn_flash_decode
    first = _decode(fn)
    arrays = _decode_arrays()
    again = _decode(fn, arrays)
    assert binds == ["fc_attn_flash_decode"]  # the second call replayed
    assert isinstance(again, Launch) and again.grid == first.grid
    assert again.arg("q") is arrays["q"] and again.arg("acc_out") is arrays["acc_out"]
    assert [type(v) for v in again.args] == [type(v) for v in first.args]
    assert again.args[len(arrays):] == first.args[len(arrays):]
    assert launched[-1][3] is again.args


@pytest.mark.parametrize("over, match", [
    (dict(q=FakeArray((NH, HD), np.float16)), "q must be float32"),
    (dict(q=FakeArray((NH, HD), strides=(8 * HD, 8))), "contiguous"),
    (dict(acc_out=FakeArray((NH * HD,))), "acc_out needs"),
    (dict(q=FakeArray((NH, HD), device=1)), "device"),
    (dict(q=np.zeros((NH, HD), np.float32)), "cupy array"),
])
def test_no_hit_for_another_array_signature(gpu, over, match):
    fn = _mods().attn_decode.fc_attn_flash_decode
    _decode(fn)
    with pytest.raises(ContractError, match=match):
        _decode(fn, _decode_arrays(**over))


def test_an_array_reshaped_in_place_binds_again(gpu):
    fn = _mods().attn_decode.fc_attn_flash_decode
    a = _decode_arrays()
    _decode(fn, a)
    a["m_out"].shape, a["m_out"].size = (1,), 1
    with pytest.raises(ContractError, match="m_out/l_out need"):
        _decode(fn, a)


@pytest.mark.parametrize("kw, match", [
    (dict(attn_sink=False), "attn_sink must be an integer"),
    (dict(attn_sink=0.0), "attn_sink must be an integer"),
    (dict(seq_len=32.0), "seq_len must be an integer"),
    (dict(scale=True), "scale must be a number"),
    (dict(attn_sink=np.int64(0), scale=np.zeros(3)), "scale must be a number"),
])
def test_no_hit_for_an_equal_scalar_of_another_type(gpu, kw, match):
    fn = _mods().attn_decode.fc_attn_flash_decode
    _decode(fn, attn_sink=0, scale=1)
    with pytest.raises(ContractError, match=match):
        _decode(fn, **{"attn_sink": 0, "scale": 1, **kw})


def test_a_float_zero_launches_with_its_own_sign(gpu):
    _, launched, _ = gpu
    fn = _mods().attn_engine.ae_f32_decode
    _decode(fn, softcap=0.0)
    b = _decode(fn, softcap=-0.0)
    assert np.signbit(b.arg("softcap")) and np.signbit(launched[-1][3][b.names.index("softcap")])
    b = _decode(fn, softcap=0.0)
    assert not np.signbit(b.arg("softcap"))


def test_argument_names_decide_as_much_as_values(gpu):
    """The same values under other names are another call."""
    mod = _mods().attn_decode
    k = mod.KERNELS["fc_attn_flash_decode"]
    a = _decode_arrays()
    path = mod.FATBINS["fc_attn_flash_decode"]
    launch.launch(k, path, {**a, "seq_len": 32, "n_splits": 2, "split_len": 16})
    with pytest.raises(ContractError, match="n_splits = 32 does not cover"):
        launch.launch(k, path, {**a, "n_splits": 32, "seq_len": 2, "split_len": 16})


def _paged_append(fn, slots, **kw):
    hk, hd, n = 1, 64, len(slots)
    return fn(FakeArray((n, hk, hd)), FakeArray((n, hk, hd)), FakeArray((4, 8, hk, hd)),
              FakeArray((4, 8, hk, hd)),
              FakeArray((n,), np.int32, host=np.asarray(slots, np.int32)), **kw)


def test_validated_device_memory_is_read_on_every_launch(gpu):
    """Paged tables and device positions are contract inputs while validate_pos."""
    _, _, binds = gpu
    fn = _mods().attn_paged.paged_f32_append
    _paged_append(fn, [0, 1])
    with pytest.raises(ContractError, match="two tokens map to one slot"):
        _paged_append(fn, [3, 3])
    _paged_append(fn, [0, 1], validate_pos=False)
    _paged_append(fn, [3, 3], validate_pos=False)  # the caller owns them: replayed
    assert binds == ["paged_f32_append"] * 3

    dev = _mods().attn_decode.fc_attn_flash_decode_dev
    a = _decode_arrays(m_out=FakeArray((NH * 16,)), l_out=FakeArray((NH * 16,)),
                       acc_out=FakeArray((NH * 16 * HD,)))
    arrays = [a[n] for n in ("q", "k_cache", "v_cache", "m_out", "l_out", "acc_out")]
    dev(*arrays, FakeArray((1,), np.int32, host=np.asarray([5], np.int32)), kps=16,
        splits_cap=16)
    with pytest.raises(ContractError, match="no ring wrap"):
        dev(*arrays, FakeArray((1,), np.int32, host=np.asarray([MS], np.int32)), kps=16,
            splits_cap=16)


def test_every_launcher_taking_validate_pos_reads_device_memory():
    """A binding is replayed only where it read no device memory: every kernel whose
    launcher takes validate_pos (its op's OpDef.validates_pos) reads it while
    validate_pos, and no other kernel does."""
    from kgen.ops import py_args
    from kgen.runtime.bind import reads_device

    for mod in _mods().MODULES.values():
        for k in mod.KERNELS.values():
            takes = "validate_pos" in {a.name for a in py_args(k)[1]}
            assert reads_device(k, {}) is takes, k.name
            assert not reads_device(k, {"validate_pos": False}), k.name


def test_the_current_device_is_part_of_the_signature(gpu):
    cp, _, _ = gpu
    fn = _mods().attn_decode.fc_attn_flash_decode
    _decode(fn)
    cp.device = 1
    with pytest.raises(ContractError, match="runs on device 1"):
        _decode(fn)


def test_the_memo_holds_no_array_of_a_call(gpu):
    fn = _mods().attn_decode.fc_attn_flash_decode
    _decode(fn)
    _decode(fn)
    held = [v for km in launch._memo.values() for lay in km.layouts.values()
            for b, *_ in lay.entries.values() for v in b.args]
    assert held and not any(isinstance(v, FakeArray) for v in held)
