"""Each parameter a caller may leave out has one home, kgen.ir.params: the generated
launchers, bind, the cache objects and their options all take its default, check
its range and use its neutral value from there."""

from __future__ import annotations

import inspect

import kgen_kernels
import numpy as np
import pytest

from kgen.ir.axes import Mode, Position, SoftCap, Window
from kgen.ir.params import INT_MAX, NO_WINDOW, PARAMS
from kgen.runtime import ContractError, bind
from kgen.runtime.kv import KVCache, Options, SlotKVCache
from kgen.runtime.paged import PagedKVCache
from kgen.testing import Case, host_args


@pytest.fixture(scope="module")
def launched():
    return {n: k for m in kgen_kernels.MODULES.values() for n, k in m.KERNELS.items()}


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def test_every_launcher_defaults_to_the_table(launched):
    seen = set()
    for name in launched:
        for p in inspect.signature(getattr(kgen_kernels, name)).parameters.values():
            if p.name in PARAMS:
                assert _same(p.default, PARAMS[p.name].default), (name, p.name)
                seen.add(p.name)
    assert seen == set(PARAMS)


@pytest.mark.parametrize("fn", [
    KVCache.__init__, KVCache.prefill, KVCache.decode, KVCache.decode_device,
    KVCache._options, SlotKVCache.__init__, SlotKVCache.decode, PagedKVCache.__init__,
    PagedKVCache.prefill, PagedKVCache.decode])
def test_the_cache_objects_default_to_the_table(fn):
    named = [p for p in inspect.signature(fn).parameters.values() if p.name in PARAMS]
    assert named
    for p in named:
        assert _same(p.default, PARAMS[p.name].default), (fn.__qualname__, p.name)


def test_options_default_to_the_neutral_path():
    o = Options()
    for name in ("attn_sink", "attn_win", "scale", "softcap"):
        assert _same(getattr(o, name), PARAMS[name].neutral), name
    exact = next(k for m in kgen_kernels.MODULES.values() for k in m.KERNELS.values()
                 if k.op.value == "flash" and k.window is Window.EXACT
                 and k.sinks.value == "none")
    assert (o.kwargs(exact)["win_left"], o.kwargs(exact)["win_right"]) == NO_WINDOW
    assert NO_WINDOW == (INT_MAX, INT_MAX)


def _flash_kernels():
    for m in kgen_kernels.MODULES.values():
        for k in m.KERNELS.values():
            if k.op.value == "flash" and k.mode is Mode.PREFILL and \
                    k.position is Position.HOST:
                yield k


def _options_kernel():
    """A host prefill kernel with a key-exact window and a soft-cap."""
    return next(k for k in _flash_kernels()
                if k.window is Window.EXACT and k.softcap is SoftCap.TANH)


def test_bind_takes_the_defaults_and_checks_the_ranges():
    k = _options_kernel()
    case = Case("p", n=2, n_head=2, n_head_kv=1)
    a = host_args(k, case)
    for name in ("attn_sink", "win_left", "win_right", "softcap", "scale"):
        a.pop(name, None)
    b = bind(k, a)
    for name in ("attn_sink", "win_left", "win_right", "softcap"):
        default = PARAMS[name].default
        assert b.arg(name) == (np.float32 if isinstance(default, float) else np.int32)(default)
    assert b.arg("scale") == np.float32(1 / np.sqrt(case.head_dim))
    for name in ("attn_sink", "win_left", "win_right"):
        p = PARAMS[name]
        bind(k, {**a, name: p.hi})
        for bad in (p.lo - 1, p.hi + 1):
            with pytest.raises(ContractError, match=name):
                bind(k, {**a, name: bad})
    for name in ("softcap", "scale"):
        p = PARAMS[name]
        with pytest.raises(ContractError, match=name):
            bind(k, {**a, name: p.lo - 1.0})
        if p.positive:
            with pytest.raises(ContractError, match=name):
                bind(k, {**a, name: float(p.lo)})
        else:
            bind(k, {**a, name: float(p.lo)})
