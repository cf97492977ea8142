"""Alignment contracts: every array a kernel reads or writes starts on the boundary of
the widest access its template makes through it (kgen.ir.signature.Param.align), and
every way in refuses one that does not, with a ContractError naming the argument, the
bytes and the address, before anything launches or changes.

1. The contracts are what the generated sources do: every kernel the specs make,
   rendered, read by kgen.testing.accesses (the widest access through each pointer
   parameter), equals its parameters' contracts; the reader itself is shown to find
   what small sources hold.
2. Every launcher checks them (kgen.runtime.bind): each built kernel, each array off
   its boundary by half its alignment, is refused; every array on its own boundary and
   on no wider one binds. Every shape a launcher accepts keeps each later row on its
   boundary too. A launch like an accepted one, off the boundary, is refused (the memo
   replays only arrays on ALIGN_MAX boundaries).
3. Every public entry point (kgen.runtime's calls and the cache objects' methods, from
   the convention's own record of them) refuses each of its array arguments off its
   element's boundary, and off its kernel's contract where that is wider, leaving
   lengths, tables and buffers as they were; on its boundary, the call runs.

CPU only: CuPy is kgen.testing.fakecupy's Guarded (arrays with addresses of our
choosing), armed for each refusal to record every allocation, upload and launch."""

from __future__ import annotations

import copy
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

import kgen.runtime as runtime
from kgen.compiler import pipeline
from kgen.compiler.render import render_units
from kgen.ir.geometry import MLA_LATENT, MLA_PREFILL_QK, MLA_PREFILL_V, MLA_ROPE, MLA_ROW
from kgen.ops import OPS, params
from kgen.runtime import ContractError, bind, tuned
from kgen.runtime import engine as eng
from kgen.runtime import launch as launching
from kgen.runtime import mla as rmla
from kgen.runtime.contracts import ALIGN_MAX
from kgen.runtime.kv import KVCache, SlotKVCache
from kgen.runtime.mla import MLACache
from kgen.runtime.paged import PagedKVCache
from kgen.runtime.select import generated
from kgen.testing import host_args
from kgen.testing.accesses import pointer_accesses
from kgen.testing.built import needs_build
from kgen.testing.fakecupy import FakeArray, Guarded, _Ptr
from kgen.testing.paged import step_tensors
from kgen.testing.testgen import cases

ROOT = Path(__file__).resolve().parents[2]


# ---- 1. the contracts are the generated sources' widest accesses ---------------------

@pytest.fixture(scope="module")
def rendered():
    """(kernel, its CUDA source) of every kernel the specs make."""
    kernels = pipeline.checked(pipeline.parse([ROOT / "specs"], ROOT))
    units = render_units(kernels, ROOT / "templates", ROOT)
    assert sorted(u.kernels[0].name for u in units) == sorted(k.name for k in kernels)
    return [(u.kernels[0], u.source) for u in units]


def test_every_contract_is_the_widest_access_its_kernel_makes(rendered):
    """Both ways: a contract below an access would let the kernel fault; one above
    every access would refuse arrays the kernel reads fine."""
    wrong, wide, arrays = [], set(), 0
    for k, source in rendered:
        got = pointer_accesses(source)[k.name]
        want = {p.name: p.align for p in params(k) if p.is_pointer}
        arrays += len(want)
        if got != want:
            wrong.append(f"{k.name}: source {got}, contracts {want}")
        wide |= {(k.op, p.name, p.align) for p in params(k)
                 if p.is_pointer and p.align > np.dtype(p.dtype).itemsize}
    assert not wrong, f"{len(wrong)} of {len(rendered)} kernels differ:\n" + "\n".join(wrong[:10])
    assert arrays >= len(rendered)
    # some wider than their elements: every cache op's (its formats' quad readers, raw V
    # tile, append writer), and MLA ops' (their quads)
    ops = {op for op, _, _ in wide}
    assert ops >= {k.op for k, _ in rendered if OPS[k.op].cache}
    assert any(OPS[op].mla for op in ops)


def test_every_contract_fits_the_replay_boundary(rendered):
    """A replay (the launch memo, a cache's remembered step) takes only arrays on an
    ALIGN_MAX boundary: that must meet every contract."""
    for k, _ in rendered:
        for p in params(k):
            if p.is_pointer:
                assert ALIGN_MAX % p.align == 0, (k.name, p.name, p.align)


READER_CASES = [  # (what it shows, source, the widths it must find)
    ("a float4 load through a local; an index read from a table carries no address",
     """__global__ void k(const float *a, const int *t, float *o) {
         const float *row = a + (size_t)t[0] * 4;
         const float4 v = reinterpret_cast<const float4 *>(row)[1];
         o[0] = v.x;
     }""", {"a": 16, "t": 4, "o": 4}),
    ("a helper's 16-bit store through its pointer argument",
     """__device__ __forceinline__ void put(const float *x, unsigned char *dst) {
         *(__half *)dst = __float2half(x[0]);
     }
     __global__ void k(const float *x, unsigned char *cache) {
         put(x, cache + 34 * blockIdx.x);
     }""", {"x": 4, "cache": 2}),
    ("block scoping: two locals of one name point into different arrays",
     """__global__ void k(const __half *a, const __half *b, const unsigned char *c) {
         { const unsigned short *sh = reinterpret_cast<const unsigned short *>(a); }
         { const uint2 *sh = reinterpret_cast<const uint2 *>(b); }
         { const unsigned int *w = (const unsigned int *)(c + 4); }
     }""", {"a": 2, "b": 8, "c": 4}),
    ("an assignment carries a pointer on; a value read through one does not",
     """__global__ void k(const float *a, const float *b, const int *pages) {
         const float *p = nullptr;
         p = b + 8;
         const float4 v = __ldg(reinterpret_cast<const float4 *>(p));
         const float4 w = __ldg(reinterpret_cast<const float4 *>(a + pages[3] * 4));
     }""", {"a": 16, "b": 16, "pages": 4}),
    ("a load the kernel guards by the array's own alignment asks nothing of the caller",
     """__global__ void k(const float *q, float *o) {
         const bool quads = (reinterpret_cast<size_t>(q) & 15) == 0;
         if (quads) o[0] = __ldg(reinterpret_cast<const float4 *>(q)).x;
     }""", {"q": 4, "o": 4}),
]


@pytest.mark.parametrize("what, source, want", READER_CASES, ids=[c[0] for c in READER_CASES])
def test_the_reader_finds_each_access(what, source, want):
    assert pointer_accesses(source) == {"k": want}


# ---- 2. every launcher checks them ----------------------------------------------------

BASE = 0x100000  # a fake device address on every boundary; arrays sit BASE apart


def _placed(x, ptr: int) -> FakeArray:
    """A host argument ``x`` (its shape, dtype and contents) at device address ``ptr``."""
    x = np.asarray(x)
    return FakeArray(x.shape, x.dtype, data=_Ptr(0, ptr), host=x)


def _arrays(k) -> list:
    return [p for p in params(k) if p.is_pointer]


@needs_build
def test_every_launcher_refuses_every_array_off_its_boundary():
    """Each built kernel at its first test case: every array at its own alignment past a
    boundary of ALIGN_MAX's multiple (on its contract, off any wider one) binds; each
    array of a contract over one byte, half its alignment off, is refused, naming it,
    its bytes and its address."""
    refusals = 0
    for k, _ in generated():
        a = host_args(k, cases(k)[0])
        arrays = _arrays(k)
        on = {p.name: _placed(a[p.name], BASE * (i + 1) + p.align % ALIGN_MAX)
              for i, p in enumerate(arrays)}
        bind(k, {**a, **on})
        for i, p in enumerate(arrays):
            if p.align == 1:
                continue
            ptr = BASE * (i + 1) + p.align // 2
            with pytest.raises(ContractError) as e:
                bind(k, {**a, **on, p.name: _placed(a[p.name], ptr)})
            assert e.value.contract == "alignment", k.name
            assert e.value.message == (f"{p.name} must start on a {p.align}-byte boundary "
                                       f"(address {ptr:#x})"), k.name
            refusals += 1
    assert refusals >= len(generated())  # every kernel has an array wider than a byte


@needs_build
def test_every_accepted_shape_keeps_each_row_on_its_boundary():
    """An array's first row on its boundary keeps the rest there: at every test shape of
    every built kernel (shapes its launcher accepts), each array it reads or writes wider
    than an element has rows of a whole number of its alignment. (Row strides other than
    a C-contiguous array's are taken by one launcher, concat_and_cache_mla's kv_c and
    k_pe, which it reads element by element: whole elements suffice, and are checked.)"""
    rows = 0
    for k, _ in generated():
        wide = [p for p in _arrays(k) if p.align > np.dtype(p.dtype).itemsize]
        for case in cases(k) if wide else ():  # each bound by testgen: accepted
            a = host_args(k, case)
            for p in wide:
                x = a[p.name]
                assert x.shape[-1] * x.dtype.itemsize % p.align == 0, (k.name, p.name, case)
                rows += 1
    assert rows


@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(tuned, "tuned", lambda *a: None)
    monkeypatch.setattr(tuned, "tuned_prefill", lambda *a: None)
    monkeypatch.setattr(rmla, "_CHOSEN", {})
    monkeypatch.setattr(eng, "_KERNELS", {})
    monkeypatch.setattr(eng, "_SCRATCH", {})
    return Guarded().install(monkeypatch)


@needs_build
def test_a_launch_like_an_accepted_one_is_checked_off_the_boundary(cp):
    """The first built kernel of each op: launched with its arrays on ALIGN_MAX
    boundaries (the memo keeps the binding), then with the same signature and its most
    aligned array off its boundary: refused, nothing launched; on its own boundary off
    ALIGN_MAX: launched (bound in full)."""
    seen = set()
    for k, fn in generated():
        if k.op in seen:
            continue
        seen.add(k.op)
        a = {n: (cp.asarray(v) if isinstance(v, np.ndarray) else v)
             for n, v in host_args(k, cases(k)[0]).items()}
        launching.launch(k, fn.fatbin, dict(a))
        launching.launch(k, fn.fatbin, dict(a))  # a memo hit
        p = max(_arrays(k), key=lambda p: p.align)
        x = a[p.name]
        off = {**a, p.name: FakeArray(x.shape, x.dtype, data=_Ptr(0, x.data.ptr + p.align // 2),
                                      host=x.host)}
        if p.align > 1:
            cp.refuses(lambda: None, f"{p.name} must start on a {p.align}-byte boundary",
                       launching.launch, k, fn.fatbin, off)
        if p.align < ALIGN_MAX:
            n = len(cp.launched)
            launching.launch(k, fn.fatbin, {**a, p.name: FakeArray(
                x.shape, x.dtype, data=_Ptr(0, x.data.ptr + p.align), host=x.host)})
            assert len(cp.launched) == n + 1
    assert seen == {k.op for k, _ in generated()}


# ---- 3. every public entry point --------------------------------------------------------

HK, H, HD, MS = 2, 4, 128, 64  # KV heads, q heads, head_dim, max_seq
NB, BS = 8, 16  # paged: blocks, positions per block


def _public() -> dict[str, tuple]:
    """Every public call of kgen.runtime with array arguments: name -> (its array
    parameters, whether it takes out= beside them), from the convention's record."""
    out = {}
    for name in runtime.__all__:
        obj = getattr(runtime, name)
        members = vars(obj).items() if inspect.isclass(obj) else [(None, obj)]
        for m, f in members:
            rec = getattr(f, "__kgen_public__", None)
            if rec is None or not rec[1]:
                continue
            extra = "out" in inspect.signature(f).parameters and "out" not in rec[1]
            out[name if m is None else f"{name}.{m}"] = (tuple(sorted(rec[1])), extra)
    return out


PUBLIC = _public()


def _up(cp, x, dtype=np.int32):
    return cp.asarray(np.asarray(x, dtype))


def _dense(cp, rows=10):
    c = KVCache(HK, HD, MS, kv="f32")
    c.prefill(cp.empty((rows, H, HD)), cp.empty((rows, HK, HD)), cp.empty((rows, HK, HD)), 0)
    return c


def _paged(cp, rows=6):
    c = PagedKVCache(NB, BS, HK, HD, kv="f32")
    sid = c.add()
    c.append([sid], cp.empty((rows, HK, HD)), cp.empty((rows, HK, HD)), [rows])
    return c, sid


def _latent(cp, rows=3):
    c = MLACache(NB, BS)
    sid = c.add()
    c.store([sid], cp.empty((rows, MLA_LATENT)), cp.empty((rows, MLA_ROPE)), [rows])
    return c, sid


def _step(cp, c, sid, rows):
    """PagedMetadata arguments of a step of ``rows`` new tokens over ``c``'s pages."""
    qsl, lens, table, slots = step_tensors(c, [sid], [rows])
    return (_up(cp, qsl), _up(cp, lens), _up(cp, table), _up(cp, slots, np.int64),
            rows, int(lens.max()))


CALLS: dict = {}  # entry point -> a good call of it: (cp) -> (the object whose state a
#                    refusal must leave, the call, args, keywords), every array it takes given


def _call(name: str):
    def keep(make):
        CALLS[name] = make
        return make
    return keep


def _rows(cp, n, heads=HK):
    return cp.empty((n, heads, HD))


@_call("KVCache.append")
def _(cp):
    c = _dense(cp)
    return c, c.append, (_rows(cp, 6), _rows(cp, 6), 10), {}


@_call("KVCache.prefill")
def _(cp):
    c = _dense(cp)
    return c, c.prefill, (_rows(cp, 6, H), _rows(cp, 6), _rows(cp, 6), 10), {
        "sinks": cp.empty((H,)), "out": _rows(cp, 6, H)}


@_call("KVCache.decode")
def _(cp):
    c = _dense(cp)
    return c, c.decode, (cp.empty((H, HD)), _rows(cp, 1), _rows(cp, 1), 10), {
        "sinks": cp.empty((H,)), "out": cp.empty((H, HD))}


@_call("KVCache.decode_device")
def _(cp):
    c = _dense(cp)
    return c, c.decode_device, (cp.empty((H, HD)), _rows(cp, 1), _rows(cp, 1),
                                _up(cp, [10])), {"sinks": cp.empty((H,)),
                                                 "out": cp.empty((H, HD))}


@_call("SlotKVCache.append")
def _(cp):
    s = SlotKVCache(2, HK, HD, MS, kv="f32")
    return s, s.append, (_rows(cp, 2), _rows(cp, 2), _up(cp, [0, 3])), {}


@_call("SlotKVCache.decode")
def _(cp):
    s = SlotKVCache(2, HK, HD, MS, kv="f32")
    return s, s.decode, (_rows(cp, 2, H), _rows(cp, 2), _rows(cp, 2), _up(cp, [0, 3])), {
        "out": _rows(cp, 2, H)}


@_call("PagedKVCache.append")
def _(cp):
    p, sid = _paged(cp)
    return p, p.append, ([sid], _rows(cp, 6), _rows(cp, 6), [6]), {}


@_call("PagedKVCache.prefill")
def _(cp):
    p, sid = _paged(cp)
    return p, p.prefill, ([sid], _rows(cp, 6, H), _rows(cp, 6), _rows(cp, 6), [6]), {
        "sinks": cp.empty((H,)), "out": _rows(cp, 6, H)}


@_call("PagedKVCache.decode")
def _(cp):
    p, sid = _paged(cp)
    return p, p.decode, ([sid], _rows(cp, 1, H), _rows(cp, 1), _rows(cp, 1)), {
        "sinks": cp.empty((H,)), "out": _rows(cp, 1, H)}


@_call("PagedKVCache.decode_device")
def _(cp):
    p, sid = _paged(cp)
    meta = p.decode_metadata(1, max_seq_len=NB * BS // 2)
    p.prepare(meta, [sid])
    return p, p.decode_device, (_rows(cp, 1, H), _rows(cp, 1), _rows(cp, 1), meta), {
        "sinks": cp.empty((1, H)), "out": _rows(cp, 1, H)}


@_call("PagedMetadata.__init__")
def _(cp):
    p, sid = _paged(cp)
    return None, runtime.PagedMetadata, _step(cp, p, sid, 6), {}


@_call("paged_attention")
def _(cp):
    p, sid = _paged(cp)
    meta = runtime.PagedMetadata(*_step(cp, p, sid, 6))
    return None, runtime.paged_attention, (_rows(cp, 6, H), p.k, p.v, meta), {
        "out": _rows(cp, 6, H), "sinks": cp.empty((H,))}


@_call("reshape_and_cache")
def _(cp):
    p, sid = _paged(cp)
    return None, runtime.reshape_and_cache, (_rows(cp, 6), _rows(cp, 6), p.k, p.v,
                                             _step(cp, p, sid, 6)[3]), {}


T, HQ, HKD = 9, 6, 2  # the dense and DFlash calls' rows, q heads and kv heads


def _dense_call(fn):
    return lambda cp: (None, fn, (cp.empty((T, HQ, 72)), cp.empty((T, HQ, 72)),
                                  cp.empty((T, HKD, 72)), cp.empty((T, HKD, 72))),
                       {"scale": 0.1})


_call("attention_dense_fast")(_dense_call(runtime.attention_dense_fast))
_call("attention_dense_flash")(_dense_call(runtime.attention_dense_flash))


@_call("dflash_block_attention")
def _(cp):
    return None, runtime.dflash_block_attention, (
        _rows(cp, T, HQ), _rows(cp, T, HQ), _rows(cp, T, HKD), _rows(cp, T, HKD),
        _up(cp, [0, 5, 9])), {"scale": 0.1}


@_call("dflash_paged_block_attention")
def _(cp):
    return None, runtime.dflash_paged_block_attention, (
        _rows(cp, T, HQ), _rows(cp, T, HQ), _rows(cp, T, HKD), _rows(cp, T, HKD),
        cp.empty((4, 4, HKD, HD)), cp.empty((4, 4, HKD, HD)), _up(cp, [0, 5, 9]),
        _up(cp, [7, 0]), _up(cp, [[3, 0], [-1, -1]])), {"scale": 0.1}


@_call("merge_attn_states")
def _(cp):
    n, h = 37, 3
    return None, runtime.merge_attn_states, (
        _rows(cp, n, h), _rows(cp, n, h), cp.empty((h, n)), _rows(cp, n, h),
        cp.empty((h, n)), cp.empty((h, n))), {}


@_call("mask_empty_context_lse")
def _(cp):
    return None, runtime.mask_empty_context_lse, (cp.empty((3, 9)), _up(cp, [0, 4, 9]),
                                                  _up(cp, [0, 3])), {}


@_call("concat_and_cache_mla")
def _(cp):
    return None, runtime.concat_and_cache_mla, (
        cp.empty((2, MLA_LATENT)), cp.empty((2, MLA_ROPE)), cp.empty((NB, BS, MLA_ROW)),
        _up(cp, [0, 5], np.int64)), {}


@_call("gather_mla_cache")
def _(cp):
    return None, runtime.gather_mla_cache, (
        cp.empty((4, MLA_ROW)), cp.empty((NB, BS, MLA_ROW)), _up(cp, np.zeros((1, 4))),
        _up(cp, [0, 4]), _up(cp, np.zeros(4)), _up(cp, [0]), 4), {}


@_call("mla_decode_attention")
def _(cp):
    return None, runtime.mla_decode_attention, (
        cp.empty((1, 16, MLA_LATENT)), cp.empty((1, 16)), cp.empty((1, 16, MLA_ROW)),
        cp.empty((NB, BS, MLA_ROW)), _up(cp, np.zeros((1, 2))), _up(cp, [3]), 0.1), {}


@_call("mla_prefill_attention")
def _(cp):
    tq, tk, h = 9, 20, 4
    return None, runtime.mla_prefill_attention, (
        cp.empty((tq, h, MLA_PREFILL_V)), cp.empty((h, tq)), cp.empty((tq, h, MLA_PREFILL_QK)),
        cp.empty((tk, h, MLA_PREFILL_QK)), cp.empty((tk, h, MLA_PREFILL_V)),
        _up(cp, [0, 4, 9]), _up(cp, [0, 10, 20]), 0.07, True, 5), {}


@_call("MLACache.store")
def _(cp):
    m, sid = _latent(cp)
    return m, m.store, ([sid], cp.empty((2, MLA_LATENT)), cp.empty((2, MLA_ROPE)), [2]), {}


@_call("MLACache.decode")
def _(cp):
    m, sid = _latent(cp)
    return m, m.decode, ([sid], cp.empty((1, 16, MLA_ROW)), cp.empty((1, MLA_LATENT)),
                         cp.empty((1, MLA_ROPE))), {}


def _state(obj) -> tuple:
    """What a refused call must leave as it was."""
    if isinstance(obj, PagedKVCache | MLACache):
        return (copy.deepcopy(obj.tables), dict(obj.lengths), list(obj.free_blocks),
                obj._next)
    if isinstance(obj, SlotKVCache):
        return (obj.scratch.m, obj.k, obj.v, obj.shadows)
    if isinstance(obj, KVCache):
        return (obj.length, obj.last_prefill, obj.last_plan, obj._pos,
                None if obj._pos is None else obj._pos.host.tolist(), obj.scratch.m,
                dict(obj._steps), dict(obj._default_plans))
    return ()  # a call of no object: only what the fake records


def _arguments(fn, args: tuple, kw: dict) -> dict:
    """The call's arguments by parameter name."""
    sig = inspect.signature(fn)
    names = [n for n in sig.parameters if n != "self"]
    return {**dict(zip(names, args, strict=False)), **kw}


def _with(fn, args: tuple, kw: dict, name: str, value) -> tuple[tuple, dict]:
    """The call with argument ``name`` replaced by ``value``."""
    names = [n for n in inspect.signature(fn).parameters if n != "self"]
    i = names.index(name)
    if i < len(args) and name not in kw:
        return (*args[:i], value, *args[i + 1:]), kw
    return args, {**kw, name: value}


def _moved(x, by: int) -> FakeArray:
    """``x``'s shape, dtype, strides and contents ``by`` bytes past where it starts."""
    return FakeArray(x.shape, x.dtype, x.strides, data=_Ptr(x.data.device_id,
                                                             x.data.ptr + by), host=x.host)


def _arrays_of(entry: str) -> tuple[str, ...]:
    names, extra = PUBLIC[entry]
    return (*names, *(("out",) if extra else ()))


def test_the_calls_cover_every_public_entry_point():
    """The cases come from the convention's record of every public call (its array
    parameters), so a new entry point or array is a new case; each has a good call
    here giving every array it takes."""
    assert set(CALLS) == set(PUBLIC)


def _takers(launches, x) -> list[tuple[str, int]]:
    """(name, contract bytes) of each kernel parameter, in launch order, that received
    ``x`` as given."""
    kernels = {k.name: k for k, _ in generated()}
    return [(p.name, p.align) for name, _, _, args, _, _ in launches
            for p, v in zip(params(kernels[name]), args, strict=True)
            if isinstance(v, FakeArray) and v.data is x.data]


def _outcome(cp, obj, fn, args, kw, name, x, by: int, takers, item: int) -> bool:
    """The call with ``name`` ``by`` bytes past ``x``'s start: refused (True) by the first
    kernel contract it breaks (the kernel's name for it, the contract's bytes), or by the
    call's own element check of an array it copies itself (the entry's name for it);
    else it runs (False), which it may only where no kernel contract breaks. A refusal
    changes nothing."""
    moved = _moved(x, by)
    a2, kw2 = _with(fn, args, kw, name, moved)
    breaks = [(p, align) for p, align in takers if by % align]
    before = _state(obj)
    n = len(cp.launched)
    cp.armed, cp.touched = True, []
    try:
        fn(*a2, **kw2)
    except ContractError as e:
        said = re.fullmatch(r"(\w+) must start on a (\d+)-byte boundary \(address "
                            rf"{moved.data.ptr:#x}\)", e.message)
        assert e.contract == "alignment" and said, f"{name} +{by}: {e}"
        assert (said[1], int(said[2])) in [*breaks[:1], (name, item)], f"{name} +{by}: {e}"
        assert cp.touched == [], f"{name} +{by}: touched the GPU before refusing"
        assert _state(obj) == before, f"{name} +{by}: changed its state before refusing"
        return True
    finally:
        cp.armed = False
    assert not breaks, f"{name} +{by}: accepted, breaking {breaks[0]}"
    assert len(cp.launched) > n or inspect.isclass(fn)
    return False


@needs_build
@pytest.mark.parametrize("entry", sorted(PUBLIC))
def test_an_entry_point_refuses_its_arrays_off_their_boundaries(cp, entry):
    """Each array argument of the call: on its boundary the call runs (a constructor
    launches nothing); half an element and a whole element off, it is refused where a
    kernel reading it as given asks more (the first contract it breaks speaks) or the
    call copies it itself, before any change, and runs otherwise. At least one of the
    call's arrays is refused."""
    refused = []
    for name in _arrays_of(entry):
        obj, fn, args, kw = CALLS[entry](cp)
        x = _arguments(fn, args, kw).get(name)
        assert isinstance(x, FakeArray), f"{entry}: the good call gives no {name}"
        item = x.dtype.itemsize
        assert item > 1, f"{entry}: {name} is bytes, on every element's boundary"
        n = len(cp.launched)
        fn(*args, **kw)  # on its boundary (and the memo's)
        assert len(cp.launched) > n or inspect.isclass(fn), f"{entry} launched nothing"
        takers = _takers(cp.launched[n:], x)
        for by in (item // 2, item):
            if _outcome(cp, obj, fn, args, kw, name, x, by, takers, item):
                refused.append((name, by))
        if takers:  # half an element off breaks any contract
            assert (name, item // 2) in refused
    assert refused, f"{entry} refused none of its arrays off their boundaries"


@needs_build
@pytest.mark.parametrize("entry, name", [("KVCache.prefill", "q"),
                                         ("paged_attention", "query"),
                                         ("reshape_and_cache", "key")])
def test_a_16_bit_argument_is_refused_off_its_element_before_it_is_widened(cp, entry, name):
    """The convention widens a float16 argument on the GPU before any kernel sees it:
    one off its element's boundary is refused by the entry's name for it, before the
    widening allocates."""
    obj, fn, args, kw = CALLS[entry](cp)
    x = _arguments(fn, args, kw)[name]
    half = FakeArray(x.shape, np.float16, data=_Ptr(0, x.data.ptr + 1))
    a2, kw2 = _with(fn, args, kw, name, half)
    cp.refuses(lambda: _state(obj), rf"{name} must start on a 2-byte boundary \(address "
               rf"{half.data.ptr:#x}\) \[contract: alignment\]", fn, *a2, **kw2)
    a3, kw3 = _with(fn, args, kw, name, FakeArray(x.shape, np.float16,
                                                  data=_Ptr(0, x.data.ptr + 2)))
    fn(*a3, **kw3)  # on its element's boundary: widened, then run
