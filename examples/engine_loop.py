"""A minimal vLLM-style engine loop over kgen: the engine owns its KV pages (one pair a
layer), allocates blocks, and builds one PagedMetadata a step that every layer shares.
A batch of three requests is prefilled in chunks (a chunk of each prompt a step), then
decoded token by token. Each layer's attention is reshape_and_cache + paged_attention;
the layers' projections are left out (random q/k/v stand in for them).

    python examples/engine_loop.py          # on a GPU, with kgen installed
"""

from __future__ import annotations

import numpy as np

import kgen
from kgen.formats import FORMATS

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 8, 2, 128
BLOCKS, BLOCK = 64, 16
PROMPTS, CHUNK, NEW_TOKENS = (40, 7, 23), 16, 4


def run(cp, kv: str = "q8_0", seed: int = 0) -> list:
    """The loop on the CuPy module ``cp``; returns each step's last layer output."""
    g = np.random.default_rng(seed)
    fmt = FORMATS[kv]
    row = fmt.row_width(HEAD_DIM)
    pages = [tuple(cp.zeros((BLOCKS, BLOCK, KV_HEADS, row), np.dtype(fmt.dtype))
                   for _ in "kv") for _ in range(LAYERS)]
    free = list(range(BLOCKS))[::-1]
    tables = [[] for _ in PROMPTS]
    done = [0] * len(PROMPTS)  # tokens in the cache
    outs = []

    def step(rows: list[int]) -> None:
        lens = [d + n for d, n in zip(done, rows, strict=True)]
        slots = []
        for r, (d, n) in enumerate(zip(done, rows, strict=True)):
            while len(tables[r]) * BLOCK < d + n:
                tables[r].append(free.pop())
            slots += [tables[r][p // BLOCK] * BLOCK + p % BLOCK for p in range(d, d + n)]
        width = max(len(t) for t in tables)
        table = np.zeros((len(rows), width), np.int32)
        for r, t in enumerate(tables):
            table[r, :len(t)] = t
        meta = kgen.PagedMetadata(
            cp.asarray(np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)),
            cp.asarray(np.array(lens, np.int32)), cp.asarray(table),
            cp.asarray(np.array(slots, np.int64)), max(rows), max(lens))
        T = sum(rows)
        for k_cache, v_cache in pages:  # one metadata, every layer
            q = cp.asarray(g.standard_normal((T, HEADS, HEAD_DIM)).astype(np.float32))
            k, v = (cp.asarray(g.standard_normal((T, KV_HEADS, HEAD_DIM)).astype(np.float32))
                    for _ in "kv")
            kgen.reshape_and_cache(k, v, k_cache, v_cache, meta, kv_cache_dtype=kv)
            out = kgen.paged_attention(q, k_cache, v_cache, meta, kv_cache_dtype=kv)
        outs.append(out)
        for r, n in enumerate(rows):
            done[r] += n

    while any(d < p for d, p in zip(done, PROMPTS, strict=True)):  # chunked prefill
        step([max(min(CHUNK, p - d), 1) if d < p else 1
              for d, p in zip(done, PROMPTS, strict=True)])
    for _ in range(NEW_TOKENS):  # decode: one token a request
        step([1] * len(PROMPTS))
    return outs


if __name__ == "__main__":
    import cupy

    steps = run(cupy)
    cupy.cuda.Device().synchronize()
    print(f"{len(steps)} steps, last output {tuple(steps[-1].shape)}, "
          f"finite: {bool(cupy.isfinite(steps[-1]).all())}")
