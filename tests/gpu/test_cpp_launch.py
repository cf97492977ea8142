"""The C++ op-level entry points (kgen::ops of the installed package's kgen_launch.hpp)
on the GPU, against the Python runtime: for every format, dense prefill and decode
(kgen.runtime.kv.KVCache), the paged store (the fp8 store with the fp8 format), paged
prefill and paged decode (kgen.runtime.paged.PagedKVCache), on the same device inputs,
give bit-identical outputs and caches; outputs are NaN-poisoned before each C++ launch,
and each format's dense prefill is also checked against the float64 NumPy reference.

Before any test, one launch runs in a process of its own (tests/cpp/launch_smoke.py,
KGEN_TRACE=1: the library logs each driver step to stderr before it takes it): a crash
inside the library fails this module with that trace instead of killing the test
process.

The library is built here with the system C++ compiler from the package's
kgen_launch.cpp and tests/cpp/kgen_ops_shim.cpp (a C ABI, loaded with ctypes) against
the CUDA toolkit's cuda.h; its fatbins are the package's (kgen_kernels.ROOT). The C++
side asks the device for its SM count (no plan given) and launches on CuPy's current
stream."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.formats import FORMATS
from kgen.runtime import ContractError
from kgen.testing import rng
from kgen.testing.cxx import build_shim, load_shim
from kgen.testing.cxx import call as shim_call

pytestmark = pytest.mark.gpu
SHIM = Path(__file__).resolve().parents[1] / "cpp" / "kgen_ops_shim.cpp"
SMOKE = SHIM.with_name("launch_smoke.py")
RTOL, ATOL = 2e-4, 2e-5
HD, HK, H, MS = 128, 2, 8, 256
OPTIONS = [{}, {"window_size": (23, 0), "softcap": 1.5, "sinks": True}]


def _dense_formats() -> list[str]:
    return sorted(FORMATS)


def _paged_formats() -> list[str]:
    from kgen.ir.axes import Position
    from kgen.runtime.select import generated

    return sorted({k.kv.value for k, _ in generated() if k.position is Position.PAGED})


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    import kgen_kernels

    root = Path(kgen_kernels.ROOT)
    if not (root / "kgen_launch.cpp").is_file():
        pytest.fail(f"{root} has no kgen_launch.cpp: the package lacks the C++ API")
    out = tmp_path_factory.mktemp("cpp") / "libkgen_ops_shim.so"
    why = build_shim(SHIM, root, out, ("-O2",))
    if why is not None and why.startswith("skip: "):
        pytest.skip(why[6:])
    assert why is None, why
    # One launch in a process of its own first: a crash in the library fails this
    # module with the library's driver trace, and the test process lives on.
    smoke = subprocess.run([sys.executable, "-I", str(SMOKE), str(out), str(root)],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "KGEN_TRACE": "1"})
    if smoke.returncode != 0:
        pytest.fail(f"one C++ launch in a fresh process exited {smoke.returncode} "
                    f"(a negative code is the signal); its trace:\n{smoke.stderr[-6000:]}")
    return load_shim(out, root)


def T(a) -> tuple:
    """A CuPy array as the shim takes it: its address and shape (C-contiguous)."""
    assert a.flags.c_contiguous
    return (a.data.ptr, a.shape)


def run(lib, fields: dict) -> None:
    """Launch one op through the C++ entry point on CuPy's current stream, with the tune
    store Python's caches read on this GPU (kgen.runtime.tuned.cache_path), read afresh."""
    import cupy as cp

    from kgen.runtime import tuned

    fields = {**fields, "tune_store": str(tuned.cache_path(*tuned.current_device()))}
    lib.kgen_ops_forget_tune_stores()
    stream = cp.cuda.get_current_stream()
    code, reply = shim_call(lib, fields, 1, stream.ptr)
    assert code == 0, reply
    stream.synchronize()


def same_bits(a, b, what: str) -> None:
    x, y = np.ascontiguousarray(a.get()), np.ascontiguousarray(b.get())
    assert x.shape == y.shape and x.dtype == y.dtype, what
    assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), \
        f"{what}: {int(np.sum(x.view(np.uint8) != y.view(np.uint8)))} bytes differ"


def _rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def _option_fields(opt: dict, sinks_dev) -> tuple[dict, dict]:
    """(Python keywords, the shim's fields) of one option set."""
    py, c = {}, {}
    if "window_size" in opt:
        py["window_size"] = opt["window_size"]
        c["window_left"], c["window_right"] = opt["window_size"]
    if "softcap" in opt:
        py["softcap"] = c["logits_soft_cap"] = opt["softcap"]
    if sinks_dev is not None:
        py["sinks"] = sinks_dev
        c["sinks"] = T(sinks_dev)
    return py, c


def _scales(kv: str) -> dict:
    return {"k_scale": 0.5, "v_scale": 0.25} if FORMATS[kv].tensor_scales else {}


@pytest.mark.parametrize("kv", _dense_formats())
@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_dense_prefill_and_decode_match_python(lib, kv, opt):
    import cupy as cp

    from kgen.runtime.kv import KVCache

    g, seed = rng()
    sc = _scales(kv)
    py_cache = KVCache(HK, HD, MS, kv=kv, **sc)
    c_cache = KVCache(HK, HD, MS, kv=kv, **sc)  # the C++ side's buffers, laid out alike
    sinks = cp.asarray(_rand(g, H) * 2) if opt.get("sinks") else None
    py_kw, c_kw = _option_fields(opt, sinks)
    base = {"kv": kv, "n_head_kv": HK, "head_dim": HD, "max_seq": MS,
            "k": T(c_cache.k), "v": T(c_cache.v), **c_kw,
            **{k: float(v) for k, v in sc.items()}}
    for name, a in zip(("k_sink", "v_sink", "k_win", "v_win"), c_cache.shadows, strict=False):
        base[name] = T(a)
    n = 37
    q, kn, vn = (cp.asarray(_rand(g, n, H, HD)), cp.asarray(_rand(g, n, HK, HD)),
                 cp.asarray(_rand(g, n, HK, HD)))
    try:
        want = py_cache.prefill(q, kn, vn, 0, **py_kw)
    except ContractError as exc:
        pytest.skip(f"no {kv} kernels with {opt}: {exc}")
    out = cp.full(q.shape, np.nan, np.float32)
    # The caller's scratch, where the plan splits the prefill's keys (as KVCache's own).
    m, l_, acc = (cp.empty(n * H * 16, np.float32), cp.empty(n * H * 16, np.float32),
                  cp.empty(n * H * 16 * HD, np.float32))
    run(lib, {"op": "attention", **base, "q": T(q), "k_new": T(kn), "v_new": T(vn),
              "out": T(out), "pos": 0, "m": T(m), "l": T(l_), "acc": T(acc)})
    same_bits(want, out, f"{kv} {opt} prefill out (seed={seed})")
    same_bits(py_cache.k, c_cache.k, f"{kv} prefill K cache")
    same_bits(py_cache.v, c_cache.v, f"{kv} prefill V cache")
    # The float64 reference over the rows the cache holds.
    # (A format with fp16 shadows reads its sink rows and window ring; its prefill
    # kernel may floor the ring at the batch's first live row.)
    sink, win = py_cache.sink, py_cache.win
    host = ref.HostCache.empty(kv, HK, MS, HD, py_cache.RING_ROWS, py_cache.SINK_ROWS, **sc)
    ref.append(kn.get(), vn.get(), host, 0, sink, win)
    kp = py_cache.kernels.get("prefill", H // HK)[0]
    floor = (ref.prefill_live_floor(0, n, py_cache.RING_ROWS)
             if kp.ring_floor.value == "batch" else None)
    exp = ref.prefill_attention_cache(q.get(), host, H // HK, 0, sink, win, 0, 0,
                                      1 / math.sqrt(HD), floor, tile=kp.tile_keys,
                                      window=opt.get("window_size"),
                                      softcap=opt.get("softcap", 0.0),
                                      sinks=None if sinks is None else sinks.get())
    np.testing.assert_allclose(out.get(), exp, rtol=RTOL, atol=ATOL,
                               err_msg=f"{kv} {opt} prefill vs reference (seed={seed})")
    m, l_, acc = (cp.empty(H * 1024, np.float32), cp.empty(H * 1024, np.float32),
                  cp.empty(H * 1024 * HD, np.float32))
    pos_dev = cp.zeros(1, np.int32)
    for pos in (n, n + 1, n + 2):
        q1, k1, v1 = (cp.asarray(_rand(g, H, HD)), cp.asarray(_rand(g, 1, HK, HD)),
                      cp.asarray(_rand(g, 1, HK, HD)))
        want = py_cache.decode(q1, k1, v1, pos, **py_kw)
        out = cp.full(q1.shape, np.nan, np.float32)
        run(lib, {"op": "attention", **base, "q": T(q1), "k_new": T(k1), "v_new": T(v1),
                  "out": T(out), "pos": pos, "m": T(m), "l": T(l_), "acc": T(acc),
                  "pos_dev": T(pos_dev)})
        same_bits(want, out, f"{kv} {opt} decode at {pos} (seed={seed})")
    same_bits(py_cache.k, c_cache.k, f"{kv} decode K cache")


@pytest.mark.parametrize("kv", _paged_formats())
@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_paged_store_prefill_and_decode_match_python(lib, kv, opt):
    import cupy as cp

    from kgen.runtime.paged import PagedKVCache

    g, seed = rng()
    sc = _scales(kv)
    py_cache = PagedKVCache(64, 16, HK, HD, kv=kv, max_blocks_per_seq=12, **sc)
    c_cache = PagedKVCache(64, 16, HK, HD, kv=kv, max_blocks_per_seq=12, **sc)
    sids = [py_cache.add() for _ in range(3)]
    sinks = cp.asarray(_rand(g, H) * 2) if opt.get("sinks") else None
    py_kw, c_kw = _option_fields(opt, sinks)
    cache = {"kv": kv, "n_head_kv": HK, "head_dim": HD, "key_cache": T(c_cache.k),
             "value_cache": T(c_cache.v), **{k: float(v) for k, v in sc.items()}}

    def tables(before: dict) -> tuple:
        """The slots the call stored at, and the block table and lengths after it."""
        slots = np.concatenate([py_cache.slot_mapping(s, range(before[s], py_cache.lengths[s]))
                                for s in sids]).astype(np.int32)
        lens = np.array([py_cache.lengths[s] for s in sids], np.int32)
        return (cp.asarray(slots), cp.asarray(py_cache.block_table(sids)), cp.asarray(lens))

    rows = [40, 5, 17]
    q, kn, vn = (cp.asarray(_rand(g, sum(rows), H, HD)), cp.asarray(_rand(g, sum(rows), HK, HD)),
                 cp.asarray(_rand(g, sum(rows), HK, HD)))
    before = dict(py_cache.lengths)
    try:
        want = py_cache.prefill(sids, q, kn, vn, rows, **py_kw)
    except ContractError as exc:
        pytest.skip(f"no paged {kv} kernels with {opt}: {exc}")
    slots, table, lens = tables(before)
    run(lib, {"op": "paged_store", **cache, "key": T(kn), "value": T(vn),
              "slot_mapping": T(slots)})
    same_bits(py_cache.k, c_cache.k, f"{kv} store K cache")
    same_bits(py_cache.v, c_cache.v, f"{kv} store V cache")
    qsl = cp.asarray(np.concatenate([[0], np.cumsum(rows)]).astype(np.int32))
    out = cp.full(q.shape, np.nan, np.float32)
    m, l_, acc = (cp.empty(sum(rows) * H * 16, np.float32),
                  cp.empty(sum(rows) * H * 16, np.float32),
                  cp.empty(sum(rows) * H * 16 * HD, np.float32))  # a split prefill's
    run(lib, {"op": "paged_attention", **cache, **c_kw, "q": T(q), "out": T(out),
              "block_table": T(table), "seq_lens": T(lens), "query_start_loc": T(qsl),
              "max_query_len": max(rows), "max_seq_len": int(lens.get().max()),
              "m": T(m), "l": T(l_), "acc": T(acc)})
    same_bits(want, out, f"{kv} {opt} paged prefill (seed={seed})")
    R = len(sids)
    m, l_, acc = (cp.empty(R * H * 1024, np.float32), cp.empty(R * H * 1024, np.float32),
                  cp.empty(R * H * 1024 * HD, np.float32))
    tiled = None  # kept alive while the C++ side reads it
    if sinks is not None:  # one logit per q head of each request
        tiled = cp.ascontiguousarray(cp.tile(sinks[None, :], (R, 1)))
        c_kw["sinks"] = T(tiled)
    for _ in range(2):
        q1, k1, v1 = (cp.asarray(_rand(g, R, H, HD)), cp.asarray(_rand(g, R, HK, HD)),
                      cp.asarray(_rand(g, R, HK, HD)))
        before = dict(py_cache.lengths)
        want = py_cache.decode(sids, q1, k1, v1, **py_kw)
        slots, table, lens = tables(before)
        run(lib, {"op": "paged_store", **cache, "key": T(k1), "value": T(v1),
                  "slot_mapping": T(slots)})
        out = cp.full(q1.shape, np.nan, np.float32)
        run(lib, {"op": "paged_attention", **cache, **c_kw, "q": T(q1), "out": T(out),
                  "block_table": T(table), "seq_lens": T(lens), "max_query_len": 1,
                  "max_seq_len": int(lens.get().max()), "m": T(m), "l": T(l_),
                  "acc": T(acc)})
        same_bits(want, out, f"{kv} {opt} paged decode (seed={seed})")
    same_bits(py_cache.k, c_cache.k, f"{kv} decode K cache")
