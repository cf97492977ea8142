"""PagedKVCache on the GPU: several sequences of different lengths share the
pages; a varlen prefill, then decode steps for all of them, each option on and
off, against the float64 references of every sequence; and the gate: on one
contiguous sequence the paged op is bit-exact with the dense one. Over every pageable
format and every pageable mixed pair (K rows in one format, V rows in another)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import numpy_ref as ref
from kgen.formats import pair
from kgen.runtime import ContractError
from kgen.testing import rng

pytestmark = pytest.mark.gpu
RTOL, ATOL = 2e-4, 2e-5
HD, HK, H = 256, 2, 8


def _paged_formats() -> list[str]:
    """Every pageable cache: a format, or a mixed pair spelled as KvPair names it (K/V)."""
    from kgen.ir.axes import Position
    from kgen.runtime.select import generated

    return sorted({k.pair.name for k, _ in generated() if k.position is Position.PAGED})


def _formats(kv: str) -> dict:
    """A cache's format arguments (kv=, v_kv=) from a _paged_formats name."""
    k, _, v = kv.partition("/")
    return {"kv": k, "v_kv": v or None}


def _scales(kv: str) -> dict:
    """Per-tensor scales that are not 1, for the roles whose format has them."""
    given = {"k_scale": 0.5, "v_scale": 0.25}
    return {n: given[n] for n in pair(**_formats(kv)).scale_scalars()}


def _rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


OPTIONS = [{}, {"window_size": (23, 0)}, {"softcap": 1.5}, {"sinks": True},
           {"window_size": (9, 0), "attn_sink": 3, "softcap": 2.0, "sinks": True}]


@pytest.mark.parametrize("kv", _paged_formats())
@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_varlen_prefill_then_decode_every_sequence(kv, opt):
    import cupy as cp

    from kgen.runtime.paged import PagedKVCache

    g, seed = rng()
    scales = _scales(kv)
    cache = PagedKVCache(64, 16, HK, HD, **_formats(kv), max_blocks_per_seq=12, **scales)
    sids = [cache.add() for _ in range(3)]
    hosts = {s: [] for s in sids}  # every row each sequence holds, in order
    sinks = _rand(g, H) * 2 if opt.get("sinks") else None
    kw = {k: v for k, v in opt.items() if k != "sinks"}
    dev_kw = {**kw, **({"sinks": cp.asarray(sinks)} if sinks is not None else {})}
    scale = 1 / math.sqrt(HD)
    G = H // HK

    def dense(s):
        kx = np.concatenate([r[0] for r in hosts[s]])
        vx = np.concatenate([r[1] for r in hosts[s]])
        c = ref.HostCache.empty(pair(**_formats(kv)), HK, len(kx), HD, **scales)
        ref.append(kx, vx, c, 0)
        return c

    for rows in ([40, 5, 17], [3, 30, 1]):  # two prefill chunks: contexts grow
        q = _rand(g, sum(rows), H, HD)
        kn, vn = _rand(g, sum(rows), HK, HD), _rand(g, sum(rows), HK, HD)
        try:
            out = cache.prefill(sids, cp.asarray(q), cp.asarray(kn), cp.asarray(vn), rows,
                                **dev_kw).get()
        except ContractError as exc:
            pytest.skip(f"no paged {kv} kernel with {opt}: {exc}")
        lo = 0
        for s, n in zip(sids, rows, strict=True):
            hosts[s].append((kn[lo:lo + n], vn[lo:lo + n]))
            c = dense(s)
            klen = sum(len(r[0]) for r in hosts[s])
            want = ref.prefill_attention_cache(q[lo:lo + n], c, G, klen - n, 0, 0,
                                               kw.get("attn_sink", 0), 0, scale,
                                               window=kw.get("window_size"),
                                               softcap=kw.get("softcap", 0.0), sinks=sinks)
            np.testing.assert_allclose(out[lo:lo + n], want, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{kv} {opt} prefill seq {s} seed={seed}")
            lo += n
    for _ in range(2):
        q = _rand(g, 3, H, HD)
        kn, vn = _rand(g, 3, HK, HD), _rand(g, 3, HK, HD)
        out = cache.decode(sids, cp.asarray(q), cp.asarray(kn), cp.asarray(vn), kps=16,
                           splits_cap=4, **dev_kw).get()
        for i, s in enumerate(sids):
            hosts[s].append((kn[i:i + 1], vn[i:i + 1]))
            c = dense(s)
            klen = c.max_seq
            kr, vr = ref.read_kv_rows(c, klen - 1)
            want = ref.decode_attention(q[i], kr, vr, G, klen, 16, 4, kw.get("attn_sink", 0),
                                        0, scale, window=kw.get("window_size"),
                                        softcap=kw.get("softcap", 0.0), sinks=sinks)
            np.testing.assert_allclose(out[i], want, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{kv} {opt} decode seq {s} seed={seed}")
    cache.free(sids[1])
    assert len(cache.free_blocks) == 64 - sum(len(cache.tables[s]) for s in (sids[0], sids[2]))


def _bit_exact_shapes():
    """(kv, head_dim, q heads per kv head): every pageable format at every model head
    size it takes, with 4 and 8 groups (the dense caches pick another tile shape at
    some of them: the paged forms must pick the same)."""
    from kgen.testing.testgen import MODEL_HEAD_DIMS

    return [(kv, hd, G) for kv in _paged_formats() for hd in MODEL_HEAD_DIMS
            if pair(**_formats(kv)).accepts_head_dim(hd) for G in (4, 8)]


def _prefill_both(g, kv: str, hd: int, G: int, paged, sid: int, n: int, scales: dict):
    """n random rows prefilled into a dense cache (from position 0) and into ``paged``'s
    sequence ``sid``: (q, k_new, v_new, the dense cache, the paged output, the dense
    output); skips where no dense prefill serves the shape."""
    import cupy as cp

    from kgen.runtime.kv import KVCache

    dense = KVCache(HK, hd, 256, **_formats(kv), **scales)
    q, kn, vn = _rand(g, n, HK * G, hd), _rand(g, n, HK, hd), _rand(g, n, HK, hd)
    try:
        b = dense.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0).get()
    except ContractError as exc:
        pytest.skip(f"no dense {kv} prefill at head_dim {hd}, {G} groups: {exc}")
    a = paged.prefill([sid], cp.asarray(q), cp.asarray(kn), cp.asarray(vn), [n]).get()
    return q, kn, vn, dense, a, b


@pytest.mark.parametrize("kv, hd, G", _bit_exact_shapes())
def test_paged_is_bit_exact_with_dense_on_one_sequence(kv, hd, G):
    """The gate: pages in a shuffled order, one sequence, the same rows: prefill and
    decode (a given plan, and each cache's default plan) give the dense kernels' bits."""
    import cupy as cp

    from kgen.runtime.paged import PagedKVCache

    g, seed = rng()
    scales = _scales(kv)
    paged = PagedKVCache(32, 16, HK, hd, **_formats(kv), **scales)
    paged.free_blocks = list(g.permutation(32).tolist())  # scattered physical blocks
    sid = paged.add()
    n, H = 70, HK * G
    _, _, _, dense, a, b = _prefill_both(g, kv, hd, G, paged, sid, n, scales)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
        f"{kv} hd{hd} G{G} prefill ({dense.last_prefill}), seed={seed}"
    for pos, plan in ((n, {"kps": 32, "splits_cap": 4}), (n + 1, {})):
        q1, k1, v1 = _rand(g, 1, H, hd), _rand(g, 1, HK, hd), _rand(g, 1, HK, hd)
        a = paged.decode([sid], cp.asarray(q1), cp.asarray(k1), cp.asarray(v1),
                         **plan).get()[0]
        b = dense.decode(cp.asarray(q1[0]), cp.asarray(k1), cp.asarray(v1), pos=pos,
                         **plan).get()
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
            f"{kv} hd{hd} G{G} decode {plan or 'default plan'}, seed={seed}"


@pytest.mark.parametrize("kv", _paged_formats())
@pytest.mark.parametrize("block_size", [1, 7, 48])
@pytest.mark.parametrize("hd", [64, 128])
def test_pages_of_any_size_give_the_dense_prefill_bits(kv, block_size, hd):
    """A varlen prefill maps each key through its page by block_size's divider (a
    multiply, not a division): pages of 1, 7 and 48 positions, shuffled, a sequence
    long enough to cross many of them (and a query tile's keys spanning several), give
    the dense prefill's bits."""
    from kgen.runtime.paged import PagedKVCache
    from kgen.runtime.select import generated

    g, seed = rng()
    scales = _scales(kv)
    n, G = 150, 4
    blocks = -(-n // block_size) + 2
    paged = PagedKVCache(blocks, block_size, HK, hd, **_formats(kv),
                         max_blocks_per_seq=blocks, **scales)
    paged.free_blocks = list(g.permutation(blocks).tolist())
    sid = paged.add()
    q, kn, vn, dense, a, b = _prefill_both(g, kv, hd, G, paged, sid, n, scales)
    host = ref.HostCache.empty(dense.pair, HK, 256, hd, dense.RING_ROWS, dense.SINK_ROWS,
                               **scales)
    ref.append(kn, vn, host, 0)
    kp = next(k for k, _ in generated() if k.name == dense.last_prefill)
    want = ref.prefill_attention_cache(q, host, G, 0, 0, 0, 0, 0, 1 / math.sqrt(hd),
                                       tile=kp.tile_keys)
    np.testing.assert_allclose(a, want, rtol=RTOL, atol=ATOL,
                               err_msg=f"{kv} hd{hd} block_size {block_size} "
                               f"({paged.last_prefill}), seed={seed}")
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
        f"{kv} hd{hd} block_size {block_size} ({paged.last_prefill}), seed={seed}"


GRAPH_OPTIONS = [{}, {"window_size": (23, 0), "softcap": 1.5}, {"sinks": True}]


@pytest.mark.parametrize("kv", _paged_formats())
@pytest.mark.parametrize("opt", GRAPH_OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_paged_decode_replays_in_a_cuda_graph(kv, opt):
    """Capture PagedKVCache.decode_device once; replaying the graph after each
    prepare (sequences growing across block boundaries, a padding row) equals the
    non-graph PagedKVCache.decode of a twin cache on the same inputs, bit for bit.
    Everything the graph reads is written in the order of the stream it replays on."""
    import cupy as cp

    from kgen.runtime.paged import PagedKVCache

    g, seed = rng()
    scales = _scales(kv)
    bs, rows = 16, [37, 15, 1]  # prefilled lengths: 15 and 1 cross a block in the steps
    R, B = len(rows), len(rows) + 1  # sequences, graph rows (the last is padding)
    plan = dict(kps=16, splits_cap=4)
    graphed = PagedKVCache(64, bs, HK, HD, **_formats(kv), max_blocks_per_seq=8, **scales)
    direct = PagedKVCache(64, bs, HK, HD, **_formats(kv), max_blocks_per_seq=8, **scales)
    direct.free_blocks = list(g.permutation(64).tolist())  # other pages: the same bits
    sg = [graphed.add() for _ in rows]
    sd = [direct.add() for _ in rows]
    n = sum(rows)
    q0, k0, v0 = _rand(g, n, H, HD), _rand(g, n, HK, HD), _rand(g, n, HK, HD)
    for c, sids in ((graphed, sg), (direct, sd)):
        c.prefill(sids, cp.asarray(q0), cp.asarray(k0), cp.asarray(v0), rows)
    logits = _rand(g, H) * 2 if opt.get("sinks") else None
    kw = {k: v for k, v in opt.items() if k != "sinks"}
    graph_kw = dict(kw, sinks=cp.asarray(np.tile(logits, (B, 1)))) if logits is not None \
        else kw
    direct_kw = dict(kw, sinks=cp.asarray(logits)) if logits is not None else kw

    meta = graphed.decode_metadata(B, max_seq_len=8 * bs)
    q = cp.zeros((B, H, HD), cp.float32)
    kn, vn = cp.zeros((B, HK, HD), cp.float32), cp.zeros((B, HK, HD), cp.float32)
    out = cp.zeros((B, H, HD), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()  # the set-up (legacy stream) is done before the stream's

    def step_inputs():
        qh, kh, vh = _rand(g, B, H, HD), _rand(g, B, HK, HD), _rand(g, B, HK, HD)
        graphed.prepare(meta, sg, stream=stream)
        q.set(qh, stream=stream), kn.set(kh, stream=stream), vn.set(vh, stream=stream)
        with stream:
            out.fill(np.nan)
        return qh, kh, vh

    def check(step, qh, kh, vh):
        stream.synchronize()
        want = direct.decode(sd, cp.asarray(qh[:R]), cp.asarray(kh[:R]), cp.asarray(vh[:R]),
                             **plan, **direct_kw).get()
        got = out.get()[:R]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
            f"{kv} {opt}: graph step {step} differs from PagedKVCache.decode, seed={seed}"
        assert [graphed.lengths[s] for s in sg] == [direct.lengths[s] for s in sd]

    # Step 0 outside the capture, validated: loads the kernels, allocates the partials.
    qh, kh, vh = step_inputs()
    try:
        graphed.decode_device(q, kn, vn, meta, out=out, stream=stream, **plan, **graph_kw)
    except ContractError as exc:
        pytest.skip(f"no paged {kv} kernel with {opt}: {exc}")
    check(0, qh, kh, vh)
    with stream:
        stream.begin_capture()
        graphed.decode_device(q, kn, vn, meta, out=out, validate=False, stream=stream,
                              **plan, **graph_kw)
        graph = stream.end_capture()
    for step in range(1, 20):  # every sequence crosses a block boundary on the way
        qh, kh, vh = step_inputs()
        graph.launch(stream)
        check(step, qh, kh, vh)
    assert all(len(graphed.tables[s]) > -(-n0 // bs) for s, n0 in zip(sg, rows, strict=True))


def test_running_out_of_blocks_changes_nothing():
    import cupy as cp

    from kgen.runtime.paged import PagedKVCache

    cache = PagedKVCache(2, 4, HK, HD, kv="f32")
    sid, other = cache.add(), cache.add()
    rows = cp.zeros((9, HK, HD), cp.float32)
    with pytest.raises(ContractError, match="out of blocks"):
        cache.append([sid, other], rows, rows, [5, 4])
    assert cache.lengths == {sid: 0, other: 0} and cache.tables == {sid: [], other: []}
    assert len(cache.free_blocks) == 2


def test_every_paged_refusal_comes_before_any_change():
    """Each refusal issue 19 found after lengths advanced and pages changed: a wrong
    head_dim, 3 q heads over 2 KV heads, a host q or host sinks (prefill and decode), a
    host k_new to append; and rows=[2.5, 2.5], decode([]). Each is a ContractError and
    leaves pages, tables, lengths and free blocks as they were."""
    import cupy as cp

    from kgen.runtime.paged import PagedKVCache

    g, seed = rng()
    cache = PagedKVCache(8, 16, HK, HD, kv="f32")
    sids = [cache.add(), cache.add()]

    def dev(*shape):
        return cp.asarray(_rand(g, *shape))

    cache.prefill(sids, dev(30, H, HD), dev(30, HK, HD), dev(30, HK, HD), [10, 20])

    def state():
        return (cache.k.get().tobytes(), cache.v.get().tobytes(),
                {s: list(t) for s, t in cache.tables.items()}, dict(cache.lengths),
                list(cache.free_blocks))

    before = state()
    k14, v14, k2, v2 = dev(14, HK, HD), dev(14, HK, HD), dev(2, HK, HD), dev(2, HK, HD)
    host_sinks = np.zeros(H, np.float32)
    calls = {
        "prefill head_dim 128": lambda: cache.prefill(sids, dev(14, H, 128), k14, v14, [7, 7]),
        "prefill 3 q heads": lambda: cache.prefill(sids, dev(14, 3, HD), k14, v14, [7, 7]),
        "prefill host q": lambda: cache.prefill(sids, _rand(g, 14, H, HD), k14, v14, [7, 7]),
        "prefill host sinks": lambda: cache.prefill(sids, dev(14, H, HD), k14, v14, [7, 7],
                                                    sinks=host_sinks),
        "prefill rows 2.5": lambda: cache.prefill(sids, dev(5, H, HD), dev(5, HK, HD),
                                                  dev(5, HK, HD), [2.5, 2.5]),
        "decode head_dim 128": lambda: cache.decode(sids, dev(2, H, 128), k2, v2),
        "decode 3 q heads": lambda: cache.decode(sids, dev(2, 3, HD), k2, v2),
        "decode host q": lambda: cache.decode(sids, _rand(g, 2, H, HD), k2, v2),
        "decode host sinks": lambda: cache.decode(sids, dev(2, H, HD), k2, v2,
                                                  sinks=host_sinks),
        "decode []": lambda: cache.decode([], dev(0, H, HD), dev(0, HK, HD), dev(0, HK, HD)),
        "append host k_new": lambda: cache.append(sids, k14.get(), v14, [7, 7]),
    }
    for name, call in calls.items():
        with pytest.raises(ContractError):
            call()
        cp.cuda.Device().synchronize()
        assert state() == before, f"{name} changed the cache before refusing, seed={seed}"


@pytest.mark.parametrize("kw", [{"k_scale": 2.0}, {"max_blocks_per_seq": 0},
                                {"variants": {"decode_paged": "no_such_kernel"}}])
def test_a_paged_cache_that_cannot_work_is_refused_at_construction(kw):
    from kgen.runtime.paged import PagedKVCache

    with pytest.raises(ContractError):
        PagedKVCache(8, 16, HK, HD, kv="f32", **kw)


@pytest.mark.parametrize("kv, hd, G", [(kv, hd, G) for kv, hd, G in _bit_exact_shapes()
                                       if G == 4 or hd == 512])
def test_non_causal_prefill_dense_and_paged(kv, hd, G):
    """causal=False: every row of a sequence sees all its keys, dense and paged, at
    every model head size; against the float64 reference, and paged bit for bit the
    dense."""
    import cupy as cp

    from kgen.runtime.kv import KVCache
    from kgen.runtime.paged import PagedKVCache

    g, seed = rng()
    scales = _scales(kv)
    paged = PagedKVCache(16, 16, HK, hd, **_formats(kv), **scales)
    paged.free_blocks = list(g.permutation(16).tolist())
    sid = paged.add()
    dense = KVCache(HK, hd, 128, **_formats(kv), **scales)
    n, H = 45, HK * G
    q, kn, vn = _rand(g, n, H, hd), _rand(g, n, HK, hd), _rand(g, n, HK, hd)
    try:
        b = dense.prefill(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), pos0=0,
                          causal=False).get()
    except ContractError as exc:  # a mixed pair's full mask is its query tile's only
        pytest.skip(f"no dense non-causal {kv} prefill at head_dim {hd}, {G} groups: {exc}")
    a = paged.prefill([sid], cp.asarray(q), cp.asarray(kn), cp.asarray(vn), [n],
                      causal=False).get()
    host = ref.HostCache.empty(dense.pair, HK, 128, hd, dense.RING_ROWS, dense.SINK_ROWS,
                               **scales)
    ref.append(kn, vn, host, 0)
    kp = dense.kernels.get("prefill", G, needs=(("mask", "full"),))[0]
    want = ref.prefill_attention_cache(q, host, G, 0, 0, 0, 0, 0, 1 / math.sqrt(hd),
                                       tile=kp.tile_keys, full=True)
    np.testing.assert_allclose(b, want, rtol=RTOL, atol=ATOL,
                               err_msg=f"{kv} hd{hd} G{G} dense ({kp.name}) seed={seed}")
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
        f"{kv} hd{hd} G{G} non-causal paged vs dense ({kp.name}), seed={seed}"


def _paged_query_tiles() -> list[str]:
    from kgen.ir.axes import Position
    from kgen.ir.geometry import query_tiles
    from kgen.runtime.select import generated

    return [k.name for k, _ in generated() if k.position is Position.PAGED
            and k.op.value == "flash" and query_tiles(k) and k.window.value == "sink_recent"]


@pytest.mark.parametrize("name", _paged_query_tiles())
def test_paged_query_tile_grid_bound_changes_no_bit(name):
    """A paged query-tile prefill sized by the tight bound on one request's rows
    (max_query_len, as PagedKVCache passes it) and by none (the batch's rows: most
    blocks return at once) writes the same bits (a split form: the same partials), the
    tight one checked against float64; a bound below the longest request is refused
    before the launch."""
    import cupy as cp

    from kgen.runtime.select import generated
    from kgen.testing.case import Case
    from kgen.testing.keywords import (
        combined,
        options,
        prefill_outputs,
        ref_options,
        shadow_args,
        split_outputs,
    )
    from kgen.testing.paged import _fill, layout

    k, fn = next((k, f) for k, f in generated() if k.name == name)
    g, seed = rng()
    hd = min(k.max_head_dim, 128)
    case = Case("bound", requests=((k.tile_rows // 2 + 7, 300), (0, 5), (3, 40),
                                   (k.tile_rows, k.tile_rows)),
                n_head=8, n_head_kv=2, head_dim=hd, block_size=16)
    lay = layout(case, g)
    pages, dense = _fill(g, k, case, lay)
    rows = int(lay["query_start_loc"][-1])
    q = _rand(g, rows, case.n_head, hd)
    args = dict(block_table=cp.asarray(lay["block_table"]), seq_lens=cp.asarray(lay["seq_lens"]),
                query_start_loc=cp.asarray(lay["query_start_loc"]), **options(k, case),
                **shadow_args(k, case))
    outs = []
    longest = max(n for n, _ in case.requests)
    for bound in (longest, None):  # a split form's partials, then folded in float64
        parts = prefill_outputs(k, rows, case.n_head, hd,
                                lambda s, d: cp.full(s, np.nan, d))
        arrays, extra = split_outputs(parts)
        fn(cp.asarray(q), cp.asarray(pages.k), cp.asarray(pages.v), *arrays,
           max_query_len=bound, **extra, **args)
        bits = [a.get().view(np.uint32) for a in arrays]
        if outs:
            assert all(np.array_equal(a, b) for a, b in zip(outs[0][1], bits, strict=True)), \
                f"{name}: the grid bound changed bits, seed={seed}"
        outs.append((combined(k, parts, rows, case.n_head, hd), bits))
    outs = [o for o, _ in outs]
    G = case.n_head // case.n_head_kv
    for r, (qlen, klen) in enumerate(case.requests):
        lo = int(lay["query_start_loc"][r])
        if qlen:
            want = ref.prefill_attention_cache(q[lo:lo + qlen], dense[r], G, klen - qlen, 0, 0,
                                               0, 0, 1 / math.sqrt(hd), None, tile=k.tile_keys,
                                               max_groups=k.max_groups,
                                               **ref_options(k, case))
            np.testing.assert_allclose(outs[0][lo:lo + qlen], want, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name} request {r}, seed={seed}")
    arrays, extra = split_outputs(prefill_outputs(k, rows, case.n_head, hd,
                                                  lambda s, d: cp.full(s, np.nan, d)))
    with pytest.raises(ContractError, match="max_query_len"):
        fn(cp.asarray(q), cp.asarray(pages.k), cp.asarray(pages.v), *arrays,
           max_query_len=longest - 1, **extra, **args)
