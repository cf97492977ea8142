"""The one public convention (kgen.runtime.convention) without a GPU: the scalar
spellings (scale, window_size), the stream argument, and every public entry point
refusing host memory and non-arrays with a ContractError before it touches anything
(a Guarded stand-in for CuPy records every allocation, upload and launch)."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

import kgen
import kgen.runtime as runtime
from kgen.ir.params import INT_MAX
from kgen.runtime import ContractError, convention
from kgen.runtime.dflash import sliding_window
from kgen.testing.fakecupy import Guarded


@pytest.fixture
def cp(monkeypatch):
    return Guarded().install(monkeypatch)


def _entries():
    """Every public call kgen.runtime exports, and every public cache method: (name,
    callable, whether it is a method)."""
    out = []
    for name in runtime.__all__:
        obj = getattr(runtime, name)
        if hasattr(obj, "__kgen_public__"):
            out.append((name, obj, False))
        elif inspect.isclass(obj):
            out += [(f"{name}.{m}", f, True) for m, f in vars(obj).items()
                    if hasattr(f, "__kgen_public__")]
    return out


ENTRIES = _entries()
TAKING = [e for e in ENTRIES if e[1].__kgen_public__[1]]  # those with array parameters


def test_every_exported_call_and_cache_method_follows_the_convention():
    """The functional ops and each cache's data-moving methods are wrapped."""
    names = {n for n, _, _ in ENTRIES}
    want = {"merge_attn_states", "attention_dense_fast", "attention_dense_flash",
            "dflash_block_attention", "dflash_paged_block_attention", "concat_and_cache_mla",
            "gather_mla_cache", "mla_decode_attention", "mla_prefill_attention"}
    for cls in ("KVCache", "PagedKVCache"):
        want |= {f"{cls}.{m}" for m in ("append", "prefill", "decode", "decode_device")}
    want |= {"SlotKVCache.append", "SlotKVCache.decode", "MLACache.store", "MLACache.decode",
             "MLACache.gather"}
    assert want <= names, sorted(want - names)


def test_kgen_exports_the_runtime():
    for name in runtime.__all__:
        assert getattr(kgen, name) is getattr(runtime, name)
    with pytest.raises(AttributeError):
        kgen.no_such_thing  # noqa: B018


@pytest.mark.parametrize("name, fn, method", TAKING, ids=[e[0] for e in TAKING])
@pytest.mark.parametrize("bad, contract", [(np.zeros((2, 2, 64), np.float32), "device"),
                                           ([[0.0, 1.0]], "array"), ("q", "array")])
def test_every_entry_refuses_a_non_gpu_array_first(cp, name, fn, method, bad, contract):
    """Host memory or a non-array in the first array parameter: a ContractError naming
    it, before anything is allocated, uploaded or launched (the wrapper's check runs
    before the call's own)."""
    _, touched, _ = fn.__kgen_public__
    params = list(inspect.signature(inspect.unwrap(fn)).parameters)
    first = next(p for p in params if p in touched)
    args = [None] * len(params)
    args[params.index(first)] = bad
    if method:
        args[0] = object()
    cp.armed, cp.touched = True, []
    with pytest.raises(ContractError) as e:
        fn(*args)
    cp.armed = False
    assert e.value.contract == contract and first in str(e.value), str(e.value)
    assert cp.touched == []


@pytest.mark.parametrize("bad", ["s", 1.5, -1, True, object()])
def test_a_stream_that_is_none_of_the_kinds_is_refused(cp, bad):
    with pytest.raises(ContractError) as e:
        convention.resolve_stream(bad, None, "who")
    assert e.value.contract == "stream"


def test_streams_as_given(cp):
    s = cp.cuda.Stream()
    assert convention.resolve_stream(s, None, "who") is s
    assert convention.resolve_stream(None, None, "who") is None  # CuPy's current
    raw = convention.resolve_stream(0x1234, None, "who")
    assert raw.ptr == 0x1234 and convention.resolve_stream(0x1234, None, "who") is raw

    class TorchLike:
        cuda_stream = 0x5678
    assert convention.resolve_stream(TorchLike(), None, "who").ptr == 0x5678


def test_scale_none_is_the_inverse_root_of_head_dim():
    assert convention.softmax_scale(None, 128) == 1 / math.sqrt(128)
    assert convention.softmax_scale(0.25, 128) == 0.25  # checked by the kernel's contract


def test_window_size_is_flash_attentions():
    """-1 on a side is no bound there (the kernels' INT_MAX); the shape is checked here,
    each side's range by the call's own parameters."""
    ws = convention.window_size
    assert ws(None, "w") is None and ws((-1, -1), "w") == (INT_MAX, INT_MAX)
    assert ws((-1, 0), "w") == (INT_MAX, 0)
    assert ws((7, -1), "w") == (7, INT_MAX)
    assert ws([3, 2], "w") == (3, 2) and ws((-5, 2), "w") == (-5, 2)
    for bad in (5, (1.5, 0), (True, 0), (1, 2, 3), "ab"):
        with pytest.raises(ContractError) as e:
            ws(bad, "w")
        assert e.value.contract == "window_size"


def test_dflash_window_size_is_its_sliding_window():
    """(left, 0) under causal is the kernels' window of left + 1 keys; no window, or an
    unbounded left, is 0 (plain causal); anything the kernels cannot serve is refused."""
    assert sliding_window(None, True) == 0 and sliding_window((-1, -1), False) == 0
    assert sliding_window((2, 0), True) == 3 and sliding_window((0, -1), True) == 1
    assert sliding_window((-1, 0), True) == 0
    assert sliding_window((INT_MAX, 0), True) == 0
    assert sliding_window((INT_MAX - 1, 0), True) == INT_MAX
    for win, causal in (((2, 0), False), ((2, 1), True), ((-1, 3), True), ((-2, 0), True)):
        with pytest.raises(ContractError) as e:
            sliding_window(win, causal)
        assert e.value.contract == "window_size"


def test_decorating_a_call_without_stream_or_with_unknown_names_fails_at_import():
    def no_stream(a):
        return a

    def f(a, stream=None):
        return a
    with pytest.raises(TypeError, match="stream"):
        convention.public("x", arrays=("a",))(no_stream)
    with pytest.raises(TypeError, match="no parameters"):
        convention.public("x", arrays=("b",))(f)


def test_arrays_of_the_current_library_pass_through_untouched(cp):
    """A CuPy array is itself (no copy, no view); host_ok values stay host values."""
    seen = {}

    @convention.public("x", arrays=("a",), host_ok=("pos",))
    def f(a, pos=None, stream=None):
        seen.update(a=a, pos=pos, stream=stream)
        return a
    a = cp.empty((3, 4))
    assert f(a, [1, 2]) is a
    assert seen == {"a": a, "pos": [1, 2], "stream": None}


def test_read_back_by_default_except_in_a_capture(cp):
    """validate=None reads device index arrays back unless the stream captures a graph;
    True and False are as given; anything else is refused."""
    s = cp.cuda.Stream()
    assert convention.read_back(None, s, "who") is True
    cp.capturing = 1
    assert convention.read_back(None, s, "who") is False
    assert convention.read_back(None, None, "who") is False  # the current stream
    assert convention.read_back(True, s, "who") is True
    cp.capturing = 0
    assert convention.read_back(False, None, "who") is False
    for bad in (1, 0, "yes"):
        with pytest.raises(ContractError) as e:
            convention.read_back(bad, s, "who")
        assert e.value.contract == "type"


def test_out_is_written_and_returned_as_the_callers_own(cp):
    """A call that returns an array shaped as q takes out=: checked before the call runs
    (a wrong one changes nothing), then the result is written into it and it is what the
    call returns."""
    ran = []

    @convention.public("x", widen_args=("q",), out_like="q")
    def f(q, stream=None):
        ran.append(q)
        return cp.empty(q.shape)
    q = cp.empty((3, 4))
    written = []

    class Out(type(q)):
        def __setitem__(self, key, value):
            written.append((key, value.shape))
    out = Out((3, 4), np.float32)
    assert f(q, out=out) is out and written == [(Ellipsis, (3, 4))] and len(ran) == 1
    for bad in (cp.empty((4, 3)), cp.empty((3, 4), np.int32)):
        with pytest.raises(ContractError) as e:
            f(q, out=bad)
        assert e.value.contract == "out"
    assert len(ran) == 1
    assert "out" in inspect.signature(f).parameters
