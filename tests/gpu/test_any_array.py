"""The one public convention on a GPU (kgen.runtime.convention): torch tensors (float32,
float16, bfloat16), CuPy arrays, DLPack capsules and __cuda_array_interface__ objects
in every public entry point, each call on the caller's stream, results in the caller's
library. Every output is poisoned first and checked element by element against the
float64 reference; a torch call also gives the CuPy call's bits on the same data.

Stream test: the inputs are written on a torch side stream behind a long sleep; a call
made under that stream (no stream argument) must see them, which it does only if it
launches on torch's current stream."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.formats import FORMATS
from kgen.runtime import (
    ContractError,
    KVCache,
    PagedKVCache,
    attention_dense_fast,
    attention_dense_flash,
    dflash_block_attention,
    merge_attn_states,
)
from kgen.testing import rng
from kgen.testing.device import ATOL, RTOL, assert_close_as

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
SLEEP = 20_000_000  # cycles the side stream sleeps before it writes the inputs


@pytest.fixture
def cp():
    import cupy

    return cupy


def _fmt(name: str):
    return FORMATS[name]


def _values(g, shape, dt: str) -> np.ndarray:
    """float32 values exactly representable in ``dt`` (drawn, then rounded through it)."""
    x = g.standard_normal(shape).astype(np.float32)
    return _fmt(dt).dequantize_rows(_fmt(dt).quantize_rows(x)) if dt != "f32" else x


def _tensor(x: np.ndarray, dt: str, stream=None):
    """A CUDA tensor of ``dt`` holding ``x``'s values, written on ``stream`` (behind a
    sleep there, so a reader on another stream would see the poison first)."""
    t = torch.full(x.shape, float("nan"), dtype=DTYPES[dt], device="cuda")
    src = torch.from_numpy(x).to(DTYPES[dt]).pin_memory()
    if stream is None:
        t.copy_(src)
        return t
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP)
        t.copy_(src, non_blocking=True)
    return t


def _host(t) -> np.ndarray:
    return t.float().cpu().numpy()


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_kvcache_prefill_and_decode_take_torch_in_the_models_dtype(dt):
    """A float32 cache fed torch q/k/v of ``dt`` on a side stream: prefill, then a
    token-major [1, H, D] decode step; results are torch tensors of ``dt`` equal to the
    float64 attention over the inputs' exact values (plus the output's rounding), and
    bit-equal to the same calls made with CuPy float32 arrays of those values."""
    g, seed = rng()
    hk, H, D, n = 2, 8, 128, 37
    q, k, v = (_values(g, (n + 1, h, D), dt) for h in (H, hk, hk))
    side = torch.cuda.Stream()
    tq, tk, tv = (_tensor(x, dt, side) for x in (q, k, v))
    cache = KVCache(hk, D, 64, kv="f32")
    with torch.cuda.stream(side):
        out = cache.prefill(tq[:n], tk[:n], tv[:n], pos0=0)
        step = cache.decode(tq[n:], tk[n:], tv[n:], pos=n)
    side.synchronize()
    assert isinstance(out, torch.Tensor) and out.dtype == DTYPES[dt] and out.is_cuda
    assert tuple(out.shape) == (n, H, D) and tuple(step.shape) == (1, H, D)
    want = ref.attention_dense(q, k, v, 1 / math.sqrt(D), True)
    fmt = _fmt(dt)
    assert_close_as("prefill", fmt, fmt.quantize_rows(_host(out)) if dt != "f32"
                    else _host(out), want[:n], seed)
    assert_close_as("decode", fmt, fmt.quantize_rows(_host(step)) if dt != "f32"
                    else _host(step), want[n:], seed)
    # the CuPy float32 path on the same values, narrowed as the convention narrows
    import cupy

    plain = KVCache(hk, D, 64, kv="f32")
    o2 = plain.prefill(cupy.asarray(q[:n]), cupy.asarray(k[:n]), cupy.asarray(v[:n]), 0)
    s2 = plain.decode(cupy.asarray(q[n]), cupy.asarray(k[n:]), cupy.asarray(v[n:]), n)
    for got, base in ((out, o2.get()), (step[0], s2.get())):
        assert np.array_equal(_bits(got), _bits(fmt.quantize_rows(base) if dt != "f32"
                                                else base)), \
            f"not the CuPy call's bits, seed={seed}"


def _bits(x) -> np.ndarray:
    """Bit patterns of a torch tensor or NumPy array (float32, or 16-bit elements)."""
    if isinstance(x, torch.Tensor):
        x = x.view(torch.int32 if x.element_size() == 4 else torch.int16).cpu().numpy()
    return np.asarray(x).view(np.int32 if np.asarray(x).itemsize == 4 else np.int16)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_paged_cache_takes_torch(dt):
    """PagedKVCache: a varlen prefill of two sequences, then a decode step of both, from
    torch tensors on a side stream; against the float64 attention of each sequence."""
    g, seed = rng()
    hk, H, D, lens = 2, 4, 64, (9, 20)
    cache = PagedKVCache(16, 16, hk, D, kv="f32")
    sids = [cache.add() for _ in lens]
    seqs = [tuple(_values(g, (n + 1, h, D), dt) for h in (H, hk, hk)) for n in lens]
    side = torch.cuda.Stream()
    cat = [np.concatenate([s[i][:n] for s, n in zip(seqs, lens, strict=True)])
           for i in range(3)]
    tq, tk, tv = (_tensor(x, dt, side) for x in cat)
    last = [_tensor(np.stack([s[i][n] for s, n in zip(seqs, lens, strict=True)]), dt, side)
            for i in range(3)]
    with torch.cuda.stream(side):
        out = cache.prefill(sids, tq, tk, tv, list(lens))
        step = cache.decode(sids, *last)
    side.synchronize()
    assert out.dtype == DTYPES[dt] and step.dtype == DTYPES[dt]
    fmt, at = _fmt(dt), 0
    for r, ((q, k, v), n) in enumerate(zip(seqs, lens, strict=True)):
        want = ref.attention_dense(q, k, v, 1 / math.sqrt(D), True)
        got = _host(out[at:at + n])
        assert_close_as(f"prefill seq {r}", fmt, fmt.quantize_rows(got) if dt != "f32"
                        else got, want[:n], seed)
        got = _host(step[r:r + 1])
        assert_close_as(f"decode seq {r}", fmt, fmt.quantize_rows(got) if dt != "f32"
                        else got, want[n:], seed)
        at += n


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_merge_writes_the_callers_tensor_on_its_stream(dt):
    """merge_attn_states in vLLM's order with torch tensors of ``dt``: the output is the
    caller's own tensor, written on torch's current (side) stream, against float64."""
    g, seed = rng()
    T, Hh, Dv = 33, 4, 128
    p, s = _values(g, (T, Hh, Dv), dt), _values(g, (T, Hh, Dv), dt)
    pl, sl = (g.standard_normal((Hh, T)).astype(np.float32) for _ in range(2))
    side = torch.cuda.Stream()
    tp, ts = _tensor(p, dt, side), _tensor(s, dt, side)
    tpl, tsl = _tensor(pl, "f32", side), _tensor(sl, "f32", side)
    out = torch.full((T, Hh, Dv), float("nan"), dtype=DTYPES[dt], device="cuda")
    out_lse = torch.full((Hh, T), float("nan"), device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        merge_attn_states(out, tp, tpl, ts, tsl, out_lse)
    side.synchronize()
    want, want_lse = ref.merge_attn_states(p, pl, s, sl)
    fmt = _fmt(dt)
    got = fmt.quantize_rows(_host(out)) if dt != "f32" else _host(out)
    assert_close_as("output", fmt, got, want, seed)
    np.testing.assert_allclose(_host(out_lse), want_lse, rtol=RTOL, atol=ATOL,
                               err_msg=f"output_lse, seed={seed}")


@pytest.mark.parametrize("entry", [attention_dense_fast, attention_dense_flash])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_dense_attention_takes_torch(entry, dt):
    g, seed = rng()
    T, H, hk, D = 40, 8, 2, 64
    q, k, v = (_values(g, (T, h, D), dt) for h in (H, hk, hk))
    side = torch.cuda.Stream()
    tq, tk, tv = (_tensor(x, dt, side) for x in (q, k, v))
    out = torch.full((T, H, D), float("nan"), dtype=DTYPES[dt], device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        entry(out, tq, tk, tv, causal=True)
    side.synchronize()
    fmt = _fmt(dt)
    got = fmt.quantize_rows(_host(out)) if dt != "f32" else _host(out)
    assert_close_as(entry.__name__, fmt, got,
                    ref.attention_dense(q, k, v, 1 / math.sqrt(D), True), seed)


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_dflash_takes_torch_with_window_size(dt):
    """DFlash with FlashAttention's window_size and the default scale, torch inputs."""
    g, seed = rng()
    H, hk, D, blocks = 8, 2, 128, (5, 1, 9)
    T = sum(blocks)
    q, k, v = (_values(g, (T, h, D), dt) for h in (H, hk, hk))
    cu = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int32)
    side = torch.cuda.Stream()
    tq, tk, tv = (_tensor(x, dt, side) for x in (q, k, v))
    tcu = torch.from_numpy(cu).cuda()
    out = torch.full((T, H, D), float("nan"), dtype=DTYPES[dt], device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        dflash_block_attention(out, tq, tk, tv, tcu, causal=True, window_size=(2, 0))
    side.synchronize()
    want = ref.dflash_block_attention(q, k, v, cu, 1 / math.sqrt(D), True, 3)
    fmt = _fmt(dt)
    got = fmt.quantize_rows(_host(out)) if dt != "f32" else _host(out)
    assert_close_as("dflash", fmt, got, want, seed)


def test_dlpack_capsules_and_cuda_array_interface(cp):
    """A DLPack capsule and a bare __cuda_array_interface__ object are read in place; the
    results equal the CuPy call's bits."""
    g, seed = rng()
    T, H, hk, D = 24, 4, 4, 64
    q, k, v = (g.standard_normal((T, h, D)).astype(np.float32) for h in (H, hk, hk))

    class Cai:
        def __init__(self, a):
            self.__cuda_array_interface__ = a.__cuda_array_interface__
            self.keep = a

    out1 = cp.full((T, H, D), np.nan, np.float32)
    attention_dense_fast(out1, cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=True)
    out2 = cp.full((T, H, D), np.nan, np.float32)
    dq = torch.from_numpy(q).cuda()
    attention_dense_fast(Cai(out2), dq.__dlpack__(), Cai(cp.asarray(k)),
                         torch.from_numpy(v).cuda(), causal=True)
    cp.cuda.Device().synchronize()
    assert_close_as("dense", _fmt("f32"), out1.get(),
                    ref.attention_dense(q, k, v, 1 / math.sqrt(D), True), seed)
    assert cp.array_equal(out1, out2), f"not the CuPy call's bits, seed={seed}"


def test_host_memory_and_non_arrays_are_contract_errors():
    """A CPU tensor, a NumPy array or a list where a GPU array belongs: ContractError,
    nothing written."""
    out = torch.full((4, 2, 64), float("nan"), device="cuda")
    good = torch.zeros((4, 2, 64), device="cuda")
    for bad, contract in ((torch.zeros((4, 2, 64)), "device"),
                          (np.zeros((4, 2, 64), np.float32), "device"),
                          ([[0.0]], "array")):
        with pytest.raises(ContractError) as e:
            attention_dense_fast(out, bad, good, good)
        assert e.value.contract == contract
    with pytest.raises(ContractError) as e:
        attention_dense_fast(out, good, good, good, stream="s")
    assert e.value.contract == "stream"
    torch.cuda.synchronize()
    assert torch.isnan(out).all()


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_cache_calls_write_out(dt):
    """prefill and decode with out=: the caller's tensor is written (q's shape, its own
    dtype) and returned, with the bits the call returns without it."""
    g, seed = rng()
    hk, H, D, n = 2, 8, 128, 19
    q, k, v = (_values(g, (n + 1, h, D), dt) for h in (H, hk, hk))
    tq, tk, tv = (_tensor(x, dt) for x in (q, k, v))
    a, b = KVCache(hk, D, 64, kv="f32"), KVCache(hk, D, 64, kv="f32")
    out = torch.full((n, H, D), float("nan"), dtype=DTYPES[dt], device="cuda")
    step = torch.full((1, H, D), float("nan"), dtype=DTYPES[dt], device="cuda")
    assert a.prefill(tq[:n], tk[:n], tv[:n], 0, out=out) is out
    assert a.decode(tq[n:], tk[n:], tv[n:], n, out=step) is step
    want = b.prefill(tq[:n], tk[:n], tv[:n], 0)
    want_step = b.decode(tq[n:], tk[n:], tv[n:], n)
    torch.cuda.synchronize()
    assert np.array_equal(_bits(out), _bits(want)), f"prefill out=, seed={seed}"
    assert np.array_equal(_bits(step), _bits(want_step)), f"decode out=, seed={seed}"
