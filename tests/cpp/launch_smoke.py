"""One launch through the C++ op entry points in a process of its own, for
tests/gpu/test_cpp_launch.py: a crash inside the library then fails that test module
with the library's trace (KGEN_TRACE=1: each driver step before it is taken) instead
of killing the test process.

    python launch_smoke.py <libkgen_ops_shim.so> <the package's generated directory>

An f32 prefill of 5 rows (2 kv heads, head_dim 128, 8 q heads) into a fresh cache,
compared with the Python KVCache's output bit for bit; prints OK and exits 0."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from kgen.testing.cxx import call, load_shim


def main(so_path: str, root: str) -> int:
    import cupy as cp

    from kgen.runtime.kv import KVCache

    so = load_shim(Path(so_path), Path(root))
    hk, hd, ms, h, n = 2, 128, 64, 8, 5
    g = np.random.default_rng(0)
    q, kn, vn = (cp.asarray(g.standard_normal(s).astype(np.float32))
                 for s in ((n, h, hd), (n, hk, hd), (n, hk, hd)))
    py, c = KVCache(hk, hd, ms, kv="f32"), KVCache(hk, hd, ms, kv="f32")
    want = py.prefill(q, kn, vn, 0)
    out = cp.full(q.shape, np.nan, np.float32)
    # The caller's scratch, where the plan splits the prefill's keys (as KVCache's own).
    m, l_, acc = (cp.empty(n * h * 16, np.float32), cp.empty(n * h * 16, np.float32),
                  cp.empty(n * h * 16 * hd, np.float32))
    cp.cuda.get_current_stream().synchronize()

    def t(a):
        return (a.data.ptr, a.shape)
    fields = {"op": "attention", "kv": "f32", "n_head_kv": hk, "head_dim": hd, "max_seq": ms,
              "k": t(c.k), "v": t(c.v), "q": t(q), "k_new": t(kn), "v_new": t(vn),
              "out": t(out), "pos": 0, "m": t(m), "l": t(l_), "acc": t(acc)}
    print("kgen smoke: calling kgen_ops_call", file=sys.stderr, flush=True)
    code, reply = call(so, fields, 1, cp.cuda.get_current_stream().ptr)
    print(f"kgen smoke: returned {code} {reply!r}", file=sys.stderr, flush=True)
    if code != 0:
        return 3
    cp.cuda.get_current_stream().synchronize()
    if not np.array_equal(out.get().view(np.uint32), want.get().view(np.uint32)):
        print("kgen smoke: the C++ prefill's bits differ from KVCache.prefill's",
              file=sys.stderr)
        return 4
    print("OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
