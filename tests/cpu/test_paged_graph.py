"""PagedKVCache's graph-capturable decode (``decode_metadata``, ``prepare``,
``decode_device``): the step uploads and allocates nothing, its launches read the
metadata's persistent tensors in place with the same arguments and grids from step
to step (what a CUDA graph replays), ``prepare`` stages what ``decode`` would upload,
and every refusal comes before anything is touched. CPU only: CuPy is
kgen.testing.fakecupy (the GPU replay is tests/gpu/test_paged.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kgen.runtime import ContractError, tuned
from kgen.runtime.paged import DecodeMetadata, PagedKVCache
from kgen.testing.built import needs_build
from kgen.testing.fakecupy import FakeArray, FakeStream, Guarded

pytestmark = needs_build
HK, H, HD = 2, 4, 256  # KV heads, q heads, head_dim
NB, BS = 8, 16  # blocks, positions per block
ROWS = [5, 15]  # prefilled lengths: the second crosses into a new block on its 2nd step
PLAN = dict(kps=16, splits_cap=4)


@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(tuned, "tuned", lambda *a: None)
    monkeypatch.setattr(tuned, "tuned_prefill", lambda *a: None)
    return Guarded().install(monkeypatch)


@pytest.fixture
def cache(cp):
    c = PagedKVCache(NB, BS, HK, HD, kv="f32", max_blocks_per_seq=4)
    sids = [c.add() for _ in ROWS]
    n = sum(ROWS)
    c.prefill(sids, cp.empty((n, H, HD)), cp.empty((n, HK, HD)), cp.empty((n, HK, HD)), ROWS)
    return c


def _io(cp, batch=2):  # len(ROWS)
    """q, k_new, v_new and out of one step (the buffers a graph captures)."""
    return (cp.empty((batch, H, HD)), cp.empty((batch, HK, HD)), cp.empty((batch, HK, HD)),
            cp.empty((batch, H, HD)))


def _state(cache, meta) -> tuple:
    """What a refused call must leave as it was: the cache's and the metadata's."""
    return (copy.deepcopy(cache.tables), dict(cache.lengths), list(cache.free_blocks),
            cache._next, meta.sids, meta.lengths, meta.scratch.m,
            *(None if t.host is None else t.host.tolist()
              for t in (meta.block_table, meta.seq_lens, meta.slot_mapping)))


def _refused(cp, cache, meta, match, fn, *a, **kw) -> None:
    cp.refuses(lambda: _state(cache, meta), match, fn, *a, **kw)


def _signature(launch: tuple) -> tuple:
    """A recorded launch as a graph node sees it: kernel, grid, block, shared memory,
    and each argument (an array by its memory, shape, dtype and strides; a scalar by
    type and value)."""
    name, grid, block, args, smem, stream = launch
    out = []
    for a in args:
        if isinstance(a, FakeArray):
            out.append(("array", a.data.ptr, a.shape, a.dtype, a.strides))
        else:
            out.append((type(a), a.item()))
    return (name, grid, block, smem, stream, tuple(out))


def _step(cp, cache, meta, io, **kw):
    """prepare, then the step armed: returns (what the step touched, its launches)."""
    q, kn, vn, out = io
    cache.prepare(meta, list(meta.cache.tables)[: len(ROWS)], stream=kw.get("stream"))
    first = len(cp.launched)
    cp.armed, cp.touched = True, []
    try:
        got = cache.decode_device(q, kn, vn, meta, out=out, **PLAN, **kw)
    finally:
        cp.armed = False
    assert got is out
    return cp.touched, cp.launched[first:]


def test_a_step_uploads_nothing_and_launches_the_same_every_step(cp, cache):
    meta = cache.decode_metadata(len(ROWS), max_seq_len=NB * BS // 2)
    io = _io(cp)
    touched, warm = _step(cp, cache, meta, io)  # warm-up: validated, allocates the partials
    assert [t[0] for t in touched] == ["launch", "alloc", "alloc", "alloc", "launch", "launch"]
    signatures, tables = [], [meta.block_table.host.tolist()]
    for _ in range(4):  # the second sequence takes a new block on the first of these
        touched, launched = _step(cp, cache, meta, io, validate=False)
        assert touched == [("launch", n) for n, *_ in launched], touched  # no upload, fill
        assert len(launched) == 3                                         # or allocation
        signatures.append([_signature(x) for x in launched])
        tables.append(meta.block_table.host.tolist())
    assert all(s == signatures[0] for s in signatures), "a step's launches differ"
    assert [_signature(x) for x in warm] == signatures[0]
    assert tables[0] != tables[-1], "no step took a block"
    append, decode, combine = (launched[i][3] for i in range(3))
    assert append[4] is meta.slot_mapping
    assert decode[6] is meta.block_table and decode[7] is meta.seq_lens
    assert combine[3].data.ptr == io[3].data.ptr  # the step's out, written in place
    # The grid is sized by the metadata's bound, not by the lengths of the step.
    width = min(-(-meta.max_seq_len // PLAN["kps"]), PLAN["splits_cap"])
    assert launched[1][1] == (width, HK, len(ROWS))


def test_prepare_stages_what_decode_would_upload(cp, cache):
    """The staged block table, lengths and slots are decode's, in stream order."""
    twin = copy.deepcopy(cache)
    meta = cache.decode_metadata(len(ROWS), max_seq_len=64)
    stream = FakeStream()
    sids = list(cache.tables)
    for _ in range(3):
        cp.armed, cp.touched = True, []
        lengths = cache.prepare(meta, sids, stream=stream)
        cp.armed = False
        assert cp.touched == [("set", t.shape, stream) for t in
                              (meta.block_table, meta.seq_lens, meta.slot_mapping)]
        first = len(cp.launched)
        twin.decode(sids, *_io(cp)[:3], **PLAN)
        append, decode, _ = (x[3] for x in cp.launched[first:])
        assert lengths == tuple(cache.lengths[s] for s in sids) == \
            tuple(twin.lengths[s] for s in sids)
        assert meta.seq_lens.host.tolist() == decode[7].host.tolist() == list(lengths)
        assert meta.block_table.host.tolist() == decode[6].host.tolist()
        assert meta.slot_mapping.host.tolist() == append[4].host.tolist() == [
            int(cache.slot_mapping(s, range(n - 1, n))[0]) for s, n in zip(sids, lengths,
                                                                            strict=True)]
        assert cache.tables == twin.tables and cache.free_blocks == twin.free_blocks
        cache.decode_device(*_io(cp)[:3], meta, stream=stream, **PLAN)


def test_the_step_and_decode_run_the_same_kernels_and_plan(cp, cache):
    twin = copy.deepcopy(cache)
    sids = list(cache.tables)
    for kw in ({}, PLAN, dict(window_size=(9, 0), softcap=2.0)):
        meta = cache.decode_metadata(len(ROWS), max_seq_len=64)
        cache.prepare(meta, sids)
        first = len(cp.launched)
        cache.decode_device(*_io(cp)[:3], meta, **kw)
        graphed = cp.launched[first:]
        first = len(cp.launched)
        twin.decode(sids, *_io(cp)[:3], **kw)
        direct = cp.launched[first:]
        assert [x[0] for x in graphed] == [x[0] for x in direct], kw
        g, d = graphed[1][3], direct[1][3]
        assert g[8:] == d[8:], kw  # kv_groups, head_dim, block_size, max_blocks, plan, options
        assert graphed[1][1][0] >= direct[1][1][0]  # as wide as the live plan, or wider


def test_sinks_are_given_per_row(cp, cache):
    meta = cache.decode_metadata(len(ROWS), max_seq_len=64)
    cache.prepare(meta, list(cache.tables))
    sinks = cp.empty((len(ROWS), H))
    first = len(cp.launched)
    cache.decode_device(*_io(cp)[:3], meta, sinks=sinks, **PLAN)
    name, _, _, args, _, _ = cp.launched[-1]
    assert len(cp.launched) - first == 3 and args[4].data is sinks.data
    assert args[4].shape == (len(ROWS) * H,)


def test_padding_rows_store_nothing(cp, cache):
    meta = cache.decode_metadata(3, max_seq_len=64)
    sid = list(cache.tables)[0]
    n = cache.lengths[sid]
    assert cache.prepare(meta, [sid]) == (n + 1,)
    assert meta.slot_mapping.host.tolist()[1:] == [-1, -1]
    assert meta.seq_lens.host.tolist() == [n + 1, 1, 1]
    out = cache.decode_device(*_io(cp, 3)[:3], meta, **PLAN)
    assert out.shape == (3, H, HD) and cp.launched[-3][1] == (3, HK, 1)


@pytest.fixture
def staged(cp, cache):
    meta = cache.decode_metadata(len(ROWS), max_seq_len=48)
    cache.prepare(meta, list(cache.tables))
    return meta


STEP_REFUSALS = [  # (what to change, match)
    (dict(q=lambda cp: cp.empty((3, H, HD))), "q must be float32 \\[2\\]"),
    (dict(q=lambda cp: cp.empty((2, 3, HD))), "GQA"),
    (dict(q=lambda cp: np.zeros((2, H, HD), np.float32)), "q must be a GPU array"),
    (dict(q=lambda cp: FakeArray((2, H, HD), device=1)), "q lives on device 1"),
    (dict(k_new=lambda cp: cp.empty((1, HK, HD))), "k_new must be float32"),
    (dict(v_new=lambda cp: cp.empty((2, HK, 128))), "v_new must be float32"),
    (dict(out=lambda cp: cp.empty((2, H, HD + 1))), "out must be"),
    (dict(out=lambda cp: cp.empty((2 * H, HD))), "out must be"),
    (dict(out=lambda cp: FakeArray((2, H, HD), strides=(8 * H * HD, 8 * HD, 8))),
     "out must be C-contiguous"),
    (dict(out=lambda cp: FakeArray((2, H, HD), device=1)), "out lives on device 1"),
    (dict(sinks=lambda cp: cp.empty((H,))), "sinks must be C-contiguous float32 \\[2\\]"),
    (dict(sinks=lambda cp: np.zeros((2, H), np.float32)), "sinks must be a GPU array"),
    (dict(kps=0), "kps"), (dict(splits_cap=2.0), "splits_cap"),
    (dict(validate=1), "validate must be True, False or None"), (dict(scale=float("inf")), "scale"),
    (dict(window_size=(3, -2)), "window right"),
]


@pytest.mark.parametrize("change, match", STEP_REFUSALS)
def test_the_step_refuses_before_touching_anything(cp, cache, staged, change, match):
    q, kn, vn, _ = _io(cp)
    args = {"q": q, "k_new": kn, "v_new": vn, **PLAN}
    args.update({k: v(cp) if callable(v) else v for k, v in change.items()})
    _refused(cp, cache, staged, match, cache.decode_device, args.pop("q"), args.pop("k_new"),
             args.pop("v_new"), staged, **args)


def test_the_step_refuses_stale_or_foreign_metadata(cp, cache, staged):
    io = _io(cp)[:3]
    fresh = cache.decode_metadata(len(ROWS), 64)
    _refused(cp, cache, fresh, "no step prepared", cache.decode_device, *io, fresh)
    other = PagedKVCache(NB, BS, HK, HD, kv="f32", max_blocks_per_seq=4)
    foreign = other.decode_metadata(len(ROWS), 64)
    _refused(cp, cache, staged, "metadata", cache.decode_device, *io, foreign)
    _refused(cp, cache, staged, "metadata", cache.decode_device, *io, "meta")
    sids = list(cache.tables)
    twin_lengths = dict(cache.lengths)
    cache.decode(sids, *io, **PLAN)  # another call advanced the sequences
    assert cache.lengths != twin_lengths
    _refused(cp, cache, staged, "changed since prepare", cache.decode_device, *io, staged)
    cache.prepare(staged, sids)
    cache.free(sids[1])
    _refused(cp, cache, staged, "changed since prepare", cache.decode_device, *io, staged)


def test_the_launch_contracts_read_the_tensors_when_validating(cp, cache, staged):
    """validate (None, the default, outside a capture) reads the staged tensors back: a
    caller that wrote a length past the metadata's bound is refused before anything launches."""
    io = _io(cp)[:3]
    staged.seq_lens.host = np.array([5, 50], np.int32)
    _refused(cp, cache, staged, "above max_seq_len = 48", cache.decode_device, *io, staged,
             **PLAN)
    staged.seq_lens.host = staged.staged[1].copy()
    staged.slot_mapping.host = np.array([3, 3], np.int32)
    _refused(cp, cache, staged, "two tokens map to one slot", cache.decode_device, *io,
             staged, **PLAN)


def test_prepare_refuses_before_taking_a_block(cp, cache):
    meta = cache.decode_metadata(len(ROWS), max_seq_len=ROWS[1])
    a, b = list(cache.tables)
    _refused(cp, cache, meta, f"max_seq_len = {ROWS[1]}", cache.prepare, meta, [a, b])
    _refused(cp, cache, meta, "3 sequences", cache.prepare, meta, [a, b, cache.add()])
    _refused(cp, cache, meta, "no sequence 9", cache.prepare, meta, [a, 9])
    _refused(cp, cache, meta, "each sequence once", cache.prepare, meta, [a, a])
    _refused(cp, cache, meta, "non-empty list", cache.prepare, meta, [])
    _refused(cp, cache, meta, "metadata", cache.prepare, object(), [a])
    small = PagedKVCache(2, BS, HK, HD, kv="f32", max_blocks_per_seq=2)
    s1, s2 = small.add(), small.add()
    small.append([s1, s2], cp.empty((2 * BS, HK, HD)), cp.empty((2 * BS, HK, HD)), [BS, BS])
    full = small.decode_metadata(2, 2 * BS)
    _refused(cp, small, full, "out of blocks", small.prepare, full, [s1, s2])


@pytest.mark.parametrize("batch, bound, match", [
    (0, 16, "batch"), (2.0, 16, "batch"), (2, 0, "max_seq_len"),
    (2, 4 * BS + 1, "max_seq_len"), (2, True, "max_seq_len")])
def test_metadata_is_refused_past_the_tables(cp, cache, batch, bound, match):
    cp.armed, cp.touched = True, []
    with pytest.raises(ContractError, match=match):
        cache.decode_metadata(batch, bound)
    cp.armed = False
    assert cp.touched == []


def test_metadata_holds_persistent_tensors(cp, cache):
    meta = cache.decode_metadata(3, 40)
    assert isinstance(meta, DecodeMetadata) and (meta.batch, meta.max_seq_len) == (3, 40)
    assert meta.block_table.shape == (3, cache.max_blocks)
    assert meta.seq_lens.shape == meta.slot_mapping.shape == (3,)
    assert {t.dtype for t in (meta.block_table, meta.seq_lens, meta.slot_mapping)} == \
        {np.dtype(np.int32)}
    tensors = (meta.block_table, meta.seq_lens, meta.slot_mapping)
    sid = list(cache.tables)[0]
    for _ in range(3):
        cache.prepare(meta, [sid])
        assert (meta.block_table, meta.seq_lens, meta.slot_mapping) == tensors
