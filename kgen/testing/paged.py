"""The paged kernels' (position = paged) layouts and GPU checks: a varlen batch of
requests, each with its own block table over shared pages (their ops build their launch
arguments from these: kgen.ops, ``contract_args``)."""

from __future__ import annotations

import math

import numpy as np

from kgen import numpy_ref as ref
from kgen.ir.axes import Mode, Sinks
from kgen.ir.kernel import Kernel
from kgen.testing.case import Case, random_bits, rng
from kgen.testing.device import assert_close, dev, poisoned
from kgen.testing.keywords import (
    combined,
    options,
    prefill_outputs,
    ref_options,
    shadow_args,
    sink_logits,
    split_outputs,
)


def step_tensors(cache, sids: list[int], rows: list[int]) -> tuple:
    """(query_start_loc, seq_lens, block_table, slot_mapping) as NumPy arrays: the index
    tensors of a step of ``rows[i]`` new tokens for sequence ``sids[i]`` of a PagedKVCache,
    laid out as the cache's own call will lay them (read before that call, which changes
    nothing here): what an engine owning those pages would pass kgen.PagedMetadata."""
    lens = [cache.lengths[s] + n for s, n in zip(sids, rows, strict=True)]
    tables = cache._grown(sids, rows)
    table = cache._block_table([tables[s] for s in sids])
    slots = np.concatenate([cache._slots(tables[s], range(cache.lengths[s],
                                                          cache.lengths[s] + n))
                            for s, n in zip(sids, rows, strict=True)])
    qsl = np.concatenate([[0], np.cumsum(rows)])
    return (qsl.astype(np.int32), np.array(lens, np.int32), table.astype(np.int32),
            slots.astype(np.int64))


def layout(case: Case, shuffle=None) -> dict:
    """Block tables (each request's blocks distinct; shuffled when ``shuffle`` is a
    generator), seq_lens and query_start_loc of a case's requests."""
    bs = case.block_size
    qlens = [q for q, _ in case.requests]
    klens = [kk for _, kk in case.requests]
    mb = max(-(-kk // bs) for kk in klens)
    nb = len(klens) * mb + 1  # one spare block nobody maps
    phys = np.arange(nb, dtype=np.int32)
    if shuffle is not None:
        shuffle.shuffle(phys)
    table = phys[: len(klens) * mb].reshape(len(klens), mb).astype(np.int32)
    return {"block_table": table, "seq_lens": np.array(klens, np.int32),
            "query_start_loc": np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32),
            "num_blocks": nb, "max_blocks": mb}


def page_caches(k: Kernel, case: Case, z, nb: int) -> dict:
    """Each role's pages in its format: ``nb`` pages of block_size rows (``z(shape,
    dtype)`` makes each array)."""
    hd, hk = case.head_dim, case.n_head_kv
    fmt = k.pair
    return {f"{r}_cache": z((nb, case.block_size, hk, fmt.of(r).row_width(hd)),
                            fmt.of(r).dtype) for r in ("k", "v")}


def _fill(g, k: Kernel, case: Case, lay: dict):
    """Random rows for every request stored through the append model; returns the
    pages and each request's dense view."""
    bs, hk, hd = case.block_size, case.n_head_kv, case.head_dim
    pages = ref.PagedCache.empty(k.pair, lay["num_blocks"], bs, hk, hd, case.k_scale,
                                 case.v_scale)
    for r, (_, klen) in enumerate(case.requests):
        kx = g.standard_normal((klen, hk, hd)).astype(np.float32)
        vx = g.standard_normal((klen, hk, hd)).astype(np.float32)
        pages.store(kx, vx, ref.slots_of(lay["block_table"][r], np.arange(klen), bs))
    dense = [ref.dense(pages, lay["block_table"][r], klen)
             for r, (_, klen) in enumerate(case.requests)]
    return pages, dense


def check_attention(k: Kernel, fn, case: Case) -> None:
    """Launch a paged attention kernel on a random varlen batch and compare with the
    dense references of every request."""
    g, seed = rng()
    lay = layout(case, g)
    pages, dense = _fill(g, k, case, lay)
    G = case.n_head // case.n_head_kv
    scale = 1.0 / math.sqrt(case.head_dim)
    idx = {n: dev(lay[n]) for n in ("block_table", "seq_lens")}
    common = dict(attn_sink=case.attn_sink, **options(k, case), **shadow_args(k, case))
    tiling = {"tile": k.tile_keys, "max_groups": k.max_groups}
    if k.mode is Mode.PREFILL:
        rows = int(lay["query_start_loc"][-1])
        q = g.standard_normal((rows, case.n_head, case.head_dim)).astype(np.float32)
        sinks = sink_logits(g, case, case.n_head)
        extra = {"sinks": dev(sinks)} if k.sinks is Sinks.LEARNED else {}
        parts = prefill_outputs(k, rows, case.n_head, case.head_dim, poisoned)
        outs, splits = split_outputs(parts)
        # The host's bound on one request's rows, as PagedKVCache passes it.
        fn(dev(q), dev(pages.k), dev(pages.v), *outs, **extra, **idx,
           query_start_loc=dev(lay["query_start_loc"]),
           max_query_len=max(n for n, _ in case.requests), **splits, **common)
        got = combined(k, parts, rows, case.n_head, case.head_dim)
        for r, (qlen, klen) in enumerate(case.requests):
            lo = int(lay["query_start_loc"][r])
            if qlen == 0:
                continue
            want = ref.prefill_attention_cache(
                q[lo:lo + qlen], dense[r], G, klen - qlen, 0, 0, case.attn_sink, case.attn_win,
                scale, None, **tiling, **ref_options(k, case),
                sinks=sinks if k.sinks is Sinks.LEARNED else None)
            assert_close(f"{k.name} request {r}", got[lo:lo + qlen], want, seed)
        return
    reqs = len(case.requests)
    q = g.standard_normal((reqs, case.n_head, case.head_dim)).astype(np.float32)
    bound = int(lay["seq_lens"].max())
    width = min(max(-(-bound // case.kps), 1), case.cap)
    heads = reqs * case.n_head
    m, l_, acc = poisoned(heads * width), poisoned(heads * width), \
        poisoned(heads * width * case.head_dim)
    fn(dev(q), dev(pages.k), dev(pages.v), m, l_, acc, **idx, kps=case.kps,
       splits_cap=case.cap, max_seq_len=bound, **common)
    pos = lay["seq_lens"] - 1
    m_ref, l_ref, acc_ref, _ = ref.decode_partials_slots(
        q, lambda u: ref.read_kv_rows(dense[u], int(pos[u])), None, pos, G, case.kps,
        case.cap, case.attn_sink, case.attn_win, scale, launch_splits=width, **tiling,
        **ref_options(k, case))
    m_got, l_got, acc_got = m.get(), l_.get(), acc.get()
    # Splits past a request's plan are never written (the kernel returns early).
    live = ~np.isinf(m_ref)
    assert_close(f"{k.name} m", m_got[live], m_ref[live], seed)
    assert_close(f"{k.name} l", l_got[live], l_ref[live], seed, rtol=8e-4)
    acc_live = np.repeat(live, case.head_dim)
    assert_close(f"{k.name} acc", acc_got[acc_live], acc_ref[acc_live], seed, rtol=8e-4,
                 atol=1.6e-4)


def check_append(k: Kernel, fn, case: Case) -> None:
    """reshape_and_cache: tokens to their slots (one skipped), everything else kept."""
    g, seed = rng()
    hk, hd, bs = case.n_head_kv, case.head_dim, case.block_size
    nb = -(-case.n // bs) + 2
    pages = ref.PagedCache.empty(k.pair, nb, bs, hk, hd, case.k_scale, case.v_scale)
    for a in (pages.k, pages.v):  # old contents must survive
        a[...] = random_bits(g, a) if a.dtype.kind in "ui" else \
            g.standard_normal(a.shape).astype(a.dtype)
    slots = g.permutation(nb * bs)[: case.n].astype(np.int32)
    slots[case.n // 2] = -1  # graph padding: skipped
    kn = g.standard_normal((case.n, hk, hd)).astype(np.float32)
    vn = g.standard_normal((case.n, hk, hd)).astype(np.float32)
    kd, vd = dev(pages.k), dev(pages.v)
    fn(dev(kn), dev(vn), kd, vd, dev(slots), **shadow_args(k, case))
    pages.store(kn, vn, slots)
    for name, got, want in (("k_cache", kd, pages.k), ("v_cache", vd, pages.v)):
        assert np.array_equal(got.get().view(np.uint8), want.view(np.uint8)), \
            f"{name} bytes differ from the {k.pair.name} store, seed={seed}"
