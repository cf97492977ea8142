"""Every public method of KVCache, SlotKVCache and PagedKVCache refuses a bad argument
with a ContractError before it touches the GPU or its own state: no array is
allocated, filled or uploaded, no kernel launched, and lengths, block tables, free
blocks, the kernel chosen last and the decode steps remembered are as they were.
CPU only: CuPy is kgen.testing.fakecupy, armed after the set-up to record every
allocation, fill and launch; NumPy arrays stand for host memory, fake arrays of
device 1 for another GPU."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kgen.runtime import ContractError, tuned
from kgen.runtime.kv import KVCache, SlotKVCache
from kgen.runtime.paged import PagedKVCache
from kgen.runtime.select import generated
from kgen.testing.built import needs_build
from kgen.testing.fakecupy import FakeArray, Guarded

pytestmark = needs_build
HK, H, HD, MS = 2, 4, 256, 64  # KV heads, q heads, head_dim, max_seq
NB, BS = 8, 16  # paged: blocks, positions per block


@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(tuned, "tuned", lambda *a: None)
    monkeypatch.setattr(tuned, "tuned_prefill", lambda *a: None)
    return Guarded().install(monkeypatch)


def _state(cache) -> tuple:
    """What a refused call must leave as it was."""
    if isinstance(cache, PagedKVCache):
        return (copy.deepcopy(cache.tables), dict(cache.lengths), list(cache.free_blocks),
                cache._next, cache.scratch.m)
    if isinstance(cache, SlotKVCache):
        return (cache.scratch.m, cache.k, cache.v, cache.shadows)
    return (cache.length, cache.last_prefill, cache.last_plan, cache._pos,
            None if cache._pos is None else cache._pos.host.tolist(), cache.scratch.m,
            dict(cache._steps), cache.k, cache.v, cache.shadows)


def refused(cp, cache, match: str, fn, *a, **kw) -> None:
    cp.refuses(lambda: _state(cache), match, fn, *a, **kw)


def _rows(cp, n, heads=HK, hd=HD):
    return cp.empty((n, heads, hd))


def _host(shape, dtype=np.float32):
    return np.zeros(shape, dtype)


def _other(shape, dtype=np.float32):
    """An array on device 1 (the launches run on device 0)."""
    return FakeArray(shape, dtype, device=1)


def _strided(cp, shape, dtype=np.float32):
    a = cp.empty(shape, dtype)
    a.strides = tuple(2 * s for s in a.strides)
    return a


# ---- KVCache -------------------------------------------------------------------------

@pytest.fixture
def dense(cp):
    """An f32 cache holding 10 rows."""
    c = KVCache(HK, HD, MS, kv="f32")
    c.prefill(cp.empty((10, H, HD)), _rows(cp, 10), _rows(cp, 10), pos0=0)
    assert c.length == 10
    return c


PREFILL_Q = [  # (q, match): q of 6 rows at pos0 10
    (lambda cp: _host((6, H, HD)), "q must be a GPU array"),
    (lambda cp: _other((6, H, HD)), "q lives on device 1"),
    (lambda cp: _strided(cp, (6, H, HD)), "q must be C-contiguous"),
    (lambda cp: cp.empty((6, H, HD), np.float64), "q must be float32"),
    (lambda cp: cp.empty((6, 3, HD)), "GQA"),
    (lambda cp: cp.empty((6, H, 128)), "q must be float32"),
    (lambda cp: cp.empty((H, HD)), "q must be float32"),
]


@pytest.mark.parametrize("q, match", PREFILL_Q)
def test_kv_prefill_refuses_q_before_appending(cp, dense, q, match):
    refused(cp, dense, match, dense.prefill, q(cp), _rows(cp, 6), _rows(cp, 6), pos0=10)


@pytest.mark.parametrize("bad", ["q", "k_new", "sinks"])
def test_a_call_like_an_accepted_one_is_checked_as_the_first(cp, bad):
    """The checks skip nothing for a signature launched before: the same shapes and
    scalars, one array on the host, is refused."""
    c = KVCache(HK, HD, MS, kv="f32")
    good = {"q": cp.empty((6, H, HD)), "k_new": _rows(cp, 6), "sinks": cp.empty((H,))}
    c.prefill(good["q"], good["k_new"], good["k_new"], pos0=0, sinks=good["sinks"])
    arrays = {**good, bad: _host(good[bad].shape)}
    refused(cp, c, f"{bad} must be a GPU array", c.prefill, arrays["q"], arrays["k_new"],
            arrays["k_new"], pos0=0, sinks=arrays["sinks"])


def test_a_paged_call_like_an_accepted_one_is_checked_as_the_first(cp, paged):
    kn = _rows(cp, 2)
    paged.decode([0, 1], cp.empty((2, H, HD)), kn, kn)
    refused(cp, paged, "q lives on device 1", paged.decode, [0, 1], _other((2, H, HD)), kn,
            kn)


@pytest.mark.parametrize("kind", ["f32", "q4"])
def test_kv_prefill_refuses_every_chunk_before_the_first(cp, kind):
    """A q4 cache with a window ring prefills in chunks: a host q is refused before
    the first chunk's rows are written."""
    c = KVCache(HK, HD, 400, kv=kind, **({"sink": 4, "win": 200} if kind == "q4" else {}))
    n = c.max_prefill_chunk() + 3 if kind == "q4" else 6
    assert n < c.max_seq
    refused(cp, c, "GPU array", c.prefill, _host((n, H, HD)), _rows(cp, n), _rows(cp, n), 0)


@pytest.mark.parametrize("sinks, match", [
    (lambda cp: _host((H,)), "sinks must be a GPU array"),
    (lambda cp: _other((H,)), "sinks lives on device 1"),
    (lambda cp: cp.empty((H + 1,)), "sinks"),
    (lambda cp: cp.empty((H,), np.float16), "sinks"),
])
def test_kv_prefill_refuses_sinks_before_appending(cp, dense, sinks, match):
    refused(cp, dense, match, dense.prefill, cp.empty((6, H, HD)), _rows(cp, 6),
            _rows(cp, 6), pos0=10, sinks=sinks(cp))


@pytest.mark.parametrize("rows, match", [
    (lambda cp: _host((6, HK, HD)), "k_new must be a GPU array"),
    (lambda cp: _other((6, HK, HD)), "k_new lives on device 1"),
    (lambda cp: _strided(cp, (6, HK, HD)), "k_new must be C-contiguous"),
    (lambda cp: cp.empty((6, HK + 1, HD)), "k_new must be float32"),
])
def test_kv_prefill_and_append_refuse_rows(cp, dense, rows, match):
    refused(cp, dense, match, dense.prefill, cp.empty((6, H, HD)), rows(cp), rows(cp),
            pos0=10)
    refused(cp, dense, match, dense.append, rows(cp), rows(cp), 10)


@pytest.mark.parametrize("causal", ["no", 0, 1, None, "False"])
def test_kv_prefill_causal_is_a_bool(cp, dense, causal):
    refused(cp, dense, "causal must be True or False", dense.prefill, cp.empty((6, H, HD)),
            _rows(cp, 6), _rows(cp, 6), pos0=10, causal=causal)


DECODE_Q = [  # (q, match) for one decode step
    (lambda cp: _host((H, HD)), "q must be a GPU array"),
    (lambda cp: _other((H, HD)), "q lives on device 1"),
    (lambda cp: _strided(cp, (H, HD)), "q must be C-contiguous"),
    (lambda cp: cp.empty((H, HD), np.int32), "q must be float32"),
    (lambda cp: cp.empty((3, HD)), "GQA"),
    (lambda cp: cp.empty((H, 128)), "q must be float32"),
]


@pytest.mark.parametrize("plan", [{}, {"kps": 16, "splits_cap": 4}])
@pytest.mark.parametrize("q, match", DECODE_Q)
def test_kv_decode_refuses_q_before_writing_the_row(cp, dense, q, match, plan):
    refused(cp, dense, match, dense.decode, q(cp), _rows(cp, 1), _rows(cp, 1), 10, **plan)


def test_kv_decode_refuses_after_a_remembered_step(cp, dense):
    """A step like a remembered one, but with a host q, is refused before its row."""
    for pos in (10, 11):
        dense.decode(cp.empty((H, HD)), _rows(cp, 1), _rows(cp, 1), pos, kps=16, splits_cap=4)
    refused(cp, dense, "q must be a GPU array", dense.decode, _host((H, HD)), _rows(cp, 1),
            _rows(cp, 1), 12, kps=16, splits_cap=4)


@pytest.mark.parametrize("sinks, match", [
    (lambda cp: _host((H,)), "sinks must be a GPU array"),
    (lambda cp: _other((H,)), "sinks lives on device 1"),
])
def test_kv_decode_refuses_sinks_before_writing_the_row(cp, dense, sinks, match):
    refused(cp, dense, match, dense.decode, cp.empty((H, HD)), _rows(cp, 1), _rows(cp, 1),
            10, sinks=sinks(cp))


def _pos(value, shape=(1,), dtype=np.int32, device=0):
    return FakeArray(shape, dtype, device=device, host=np.full(shape, value, dtype))


@pytest.mark.parametrize("pos, match", [
    (lambda: _pos(MS), "exceeds max_seq"),       # an f32 append would wrap to row 0
    (lambda: _pos(-1), "negative position"),
    (lambda: _pos(3, shape=(2,)), r"pos_dev must be int32 \[1\]"),
    (lambda: _pos(3, shape=()), r"pos_dev must be int32 \[1\]"),
    (lambda: [3], "pos_dev must be a GPU array"),
    (lambda: _pos(3, dtype=np.int64), "pos must be int32"),
    (lambda: np.full(1, 3, np.int32), "pos_dev must be a GPU array"),
    (lambda: _pos(3, device=1), "pos lives on device 1"),
])
def test_kv_decode_device_refuses_the_position_before_writing_the_row(cp, dense, pos, match):
    refused(cp, dense, match, dense.decode_device, cp.empty((H, HD)), _rows(cp, 1),
            _rows(cp, 1), pos())


@pytest.mark.parametrize("out, match", [
    (lambda cp: cp.empty((H, HD + 1)), r"out must be float32 \[4\]\[256\]"),
    (lambda cp: cp.empty((H + 1, HD)), r"out must be float32 \[4\]\[256\]"),
    (lambda cp: cp.empty((H, HD), np.float16), "out must be float32"),
    (lambda cp: _host((H, HD)), "out must be a GPU array"),
    (lambda cp: _strided(cp, (H, HD)), "out must be C-contiguous"),
])
def test_kv_decode_device_refuses_out(cp, dense, out, match):
    refused(cp, dense, match, dense.decode_device, cp.empty((H, HD)), _rows(cp, 1),
            _rows(cp, 1), _pos(10), out=out(cp))


@pytest.mark.parametrize("q, match", DECODE_Q)
def test_kv_decode_device_refuses_q(cp, dense, q, match):
    refused(cp, dense, match, dense.decode_device, q(cp), _rows(cp, 1), _rows(cp, 1),
            _pos(10))


# ---- SlotKVCache ---------------------------------------------------------------------

@pytest.fixture
def slots(cp):
    return SlotKVCache(3, HK, HD, MS, kv="f32")


@pytest.mark.parametrize("q, match", [
    (lambda cp: _strided(cp, (3, H, HD)), "q must be C-contiguous"),
    (lambda cp: _host((3, H, HD)), "q must be a GPU array"),
    (lambda cp: _other((3, H, HD)), "q lives on device 1"),
])
def test_slot_decode_refuses_q_before_appending(cp, slots, q, match):
    refused(cp, slots, match, slots.decode, q(cp), _rows(cp, 3), _rows(cp, 3), [1, 2, 3])


@pytest.mark.parametrize("rows, match", [
    (lambda cp: _host((3, HK, HD)), "k_new must be a GPU array"),
    (lambda cp: _strided(cp, (3, HK, HD)), "k_new must be C-contiguous"),
])
def test_slot_append_and_decode_refuse_rows(cp, slots, rows, match):
    refused(cp, slots, match, slots.append, rows(cp), rows(cp), [1, 2, 3])
    refused(cp, slots, match, slots.decode, cp.empty((3, H, HD)), rows(cp), rows(cp),
            [1, 2, 3])


@pytest.mark.parametrize("u", [3, -1, True, 1.0, "0"])
def test_slot_prefill_refuses_a_slot_out_of_range(cp, slots, u):
    refused(cp, slots, "slot", slots.prefill, u, cp.empty((2, H, HD)), _rows(cp, 2),
            _rows(cp, 2), 0)


def test_slot_prefill_refuses_q_before_appending(cp, slots):
    refused(cp, slots, "q must be a GPU array", slots.prefill, 1, _host((2, H, HD)),
            _rows(cp, 2), _rows(cp, 2), 0)


# ---- PagedKVCache --------------------------------------------------------------------

@pytest.fixture
def paged(cp):
    """Two sequences of 10 and 20 positions (3 of 8 blocks of 16 taken)."""
    c = PagedKVCache(NB, BS, HK, HD, kv="f32")
    a, b = c.add(), c.add()
    c.prefill([a, b], cp.empty((30, H, HD)), _rows(cp, 30), _rows(cp, 30), [10, 20])
    assert c.lengths == {a: 10, b: 20} and len(c.free_blocks) == NB - 3
    return c


PAGED_Q = [  # (q of rows n, match)
    (lambda cp, n: cp.empty((n, H, 128)), "q must be float32"),
    (lambda cp, n: cp.empty((n, 3, HD)), "GQA"),
    (lambda cp, n: _host((n, H, HD)), "q must be a GPU array"),
    (lambda cp, n: _other((n, H, HD)), "q lives on device 1"),
    (lambda cp, n: _strided(cp, (n, H, HD)), "q must be C-contiguous"),
    (lambda cp, n: cp.empty((n, H, HD), np.float64), "q must be float32"),
    (lambda cp, n: cp.empty((n + 1, H, HD)), "q must be float32"),
]


@pytest.mark.parametrize("q, match", PAGED_Q)
def test_paged_prefill_refuses_q_before_taking_blocks(cp, paged, q, match):
    refused(cp, paged, match, paged.prefill, [0, 1], q(cp, 14), _rows(cp, 14), _rows(cp, 14),
            [7, 7])


@pytest.mark.parametrize("q, match", PAGED_Q)
def test_paged_decode_refuses_q_before_taking_blocks(cp, paged, q, match):
    refused(cp, paged, match, paged.decode, [0, 1], q(cp, 2), _rows(cp, 2), _rows(cp, 2))


@pytest.mark.parametrize("sinks, match", [
    (lambda cp: _host((H,)), "sinks must be a GPU array"),
    (lambda cp: _other((H,)), "sinks lives on device 1"),
    (lambda cp: cp.empty((H - 1,)), "sinks"),
])
def test_paged_refuses_sinks_before_taking_blocks(cp, paged, sinks, match):
    refused(cp, paged, match, paged.prefill, [0, 1], cp.empty((14, H, HD)), _rows(cp, 14),
            _rows(cp, 14), [7, 7], sinks=sinks(cp))
    refused(cp, paged, match, paged.decode, [0, 1], cp.empty((2, H, HD)), _rows(cp, 2),
            _rows(cp, 2), sinks=sinks(cp))


@pytest.mark.parametrize("rows, match", [
    (lambda cp: _other((14, HK, HD)), "k_new lives on device 1"),
    (lambda cp: _host((14, HK, HD)), "k_new must be a GPU array"),
    (lambda cp: _strided(cp, (14, HK, HD)), "k_new must be C-contiguous"),
    (lambda cp: cp.empty((14, HK, 128)), "k_new must be float32"),
])
def test_paged_append_refuses_rows_before_taking_blocks(cp, paged, rows, match):
    refused(cp, paged, match, paged.append, [0, 1], rows(cp), rows(cp), [7, 7])


@pytest.mark.parametrize("sids, rows, match", [
    ([0, 1], [2.5, 2.5], r"rows\[0\] must be an integer"),
    ([0, 1], [7, -1], r"rows\[1\] must be an integer"),
    ([0, 1], [7, True], r"rows\[1\] must be an integer"),
    ([0, 1], [14], "one count per sequence"),
    ([0, 1], 14, "one count per sequence"),
    ([0, 0], [7, 7], "each sequence once"),
    ([0, 5], [7, 7], "no sequence 5"),
    ([0, [1]], [7, 7], r"no sequence \[1\]"),
    ([], [], "non-empty list"),
    (0, [14], "non-empty list"),
])
def test_paged_refuses_a_bad_batch(cp, paged, sids, rows, match):
    n = 14
    q, kn = cp.empty((n, H, HD)), _rows(cp, n)
    refused(cp, paged, match, paged.append, sids, kn, kn, rows)
    refused(cp, paged, match, paged.prefill, sids, q, kn, kn, rows)


@pytest.mark.parametrize("sids, match", [
    ([], "non-empty list"), ([0, 0], "each sequence once"), ([7], "no sequence 7"),
    ("01", "non-empty list"), (None, "non-empty list"), ((0, 1.0), "no sequence 1.0"),
])
def test_paged_decode_refuses_bad_sequences(cp, paged, sids, match):
    refused(cp, paged, match, paged.decode, sids, cp.empty((2, H, HD)), _rows(cp, 2),
            _rows(cp, 2))


@pytest.mark.parametrize("rows, match", [([7, 7 + 5 * BS], "out of blocks"),
                                         ([7 + 7 * BS, 7], "max_blocks_per_seq")])
def test_paged_refuses_a_batch_past_the_blocks(cp, paged, rows, match):
    q, kn = cp.empty((sum(rows), H, HD)), _rows(cp, sum(rows))
    refused(cp, paged, match, paged.append, [0, 1], kn, kn, rows)
    refused(cp, paged, match, paged.prefill, [0, 1], q, kn, kn, rows)


def test_paged_decode_refuses_a_sequence_past_its_blocks(cp):
    c = PagedKVCache(NB, BS, HK, HD, kv="f32", max_blocks_per_seq=1)
    sid = c.add()
    c.append([sid], _rows(cp, BS), _rows(cp, BS), [BS])
    refused(cp, c, "max_blocks_per_seq", c.decode, [sid], cp.empty((1, H, HD)), _rows(cp, 1),
            _rows(cp, 1))


@pytest.mark.parametrize("call, match", [
    (lambda c: c.free(9), "no sequence 9"), (lambda c: c.free("0"), "no sequence '0'"),
    (lambda c: c.block_table([0, 9]), "no sequence 9"),
    (lambda c: c.block_table(0), "non-empty list"),
    (lambda c: c.slot_mapping(0, range(0, BS + 1)), "positions must be a range"),
    (lambda c: c.slot_mapping(0, range(-1, 3)), "positions must be a range"),
    (lambda c: c.slot_mapping(0, [1, 2]), "positions must be a range"),
    (lambda c: c.slot_mapping(4, range(2)), "no sequence 4"),
])
def test_paged_queries_refuse_unknown_sequences(cp, paged, call, match):
    refused(cp, paged, match, call, paged)


# ---- constructors: refused at once, not at the first call ----------------------------

def _kernel(op: str, mode: str | None, position: str, kv: str = "f32") -> str:
    return next(k.name for k, _ in generated() if k.op.value == op and k.position.value ==
                position and k.kv.value == kv and (mode is None or k.mode.value == mode))


@pytest.mark.parametrize("make, match", [
    (lambda: PagedKVCache(NB, BS, HK, HD, kv="f32", k_scale=2.0), "no per-tensor scales"),
    (lambda: PagedKVCache(NB, BS, HK, HD, kv="f32", v_scale=0.5), "no per-tensor scales"),
    (lambda: PagedKVCache(NB, BS, HK, HD, kv="f32", max_blocks_per_seq=0),
     "max_blocks_per_seq"),
    (lambda: PagedKVCache(NB, BS, HK, HD, kv="f32", max_blocks_per_seq=-2),
     "max_blocks_per_seq"),
    (lambda: PagedKVCache(NB, BS, HK, HD, kv="f32", variants={"prefill_paged": "nope"}),
     "no generated kernel 'nope'"),
    (lambda: PagedKVCache(NB, BS, HK, HD, kv="f32",
                          variants={"decode_paged": _kernel("flash", "prefill", "paged")}),
     "cannot serve"),
    (lambda: KVCache(HK, HD, MS, kv="f32", prefill_kernel="nope"), "no generated kernel"),
    (lambda: KVCache(HK, HD, MS, kv="f32", variants={"decode": "nope"}),
     "no generated kernel"),
    (lambda: KVCache(HK, HD, MS, kv="f32",
                     prefill_kernel=_kernel("flash", "decode", "host")), "cannot serve"),
    (lambda: KVCache(HK, HD, MS, kv="f32",
                     variants={"prefill": _kernel("flash", "prefill", "host", "q8_0")}),
     "cannot serve"),
    (lambda: KVCache(HK, HD, MS, kv="f32", variants=["prefill"]), "variants"),
    (lambda: SlotKVCache(3, HK, HD, MS, kv="f32", variants={"decode_slots": "nope"}),
     "no generated kernel"),
])
def test_constructors_refuse_at_once(cp, make, match):
    cp.armed = True
    with pytest.raises(ContractError, match=match):
        make()
    assert cp.touched == [], f"allocated before refusing: {cp.touched}"


def test_slot_refuses_an_unknown_prefill_kernel(cp, slots):
    refused(cp, slots, "no generated kernel", slots.slot, 0, prefill_kernel="nope")


# ---- what is accepted still runs -----------------------------------------------------

def test_accepted_calls_still_launch_and_advance(cp, dense, paged, slots):
    """The checks run first; the launches and the state changes then happen as before."""
    first = len(cp.launched)
    before = dense.length
    dense.decode_device(cp.empty((H, HD)), _rows(cp, 1), _rows(cp, 1), _pos(12),
                        validate=False)
    assert dense.length == before  # unread: the host does not know the position
    dense.decode_device(cp.empty((H, HD)), _rows(cp, 1), _rows(cp, 1), _pos(10))
    assert dense.length == max(before, 11)  # read by the check: length follows, as decode
    out = dense.decode(cp.empty((H, HD)), _rows(cp, 1), _rows(cp, 1), 10)
    assert out.shape == (H, HD) and dense.length == 11 and dense._pos.host.tolist() == [10]
    got = paged.decode([0, 1], cp.empty((2, H, HD)), _rows(cp, 2), _rows(cp, 2),
                       sinks=cp.empty((H,)))
    assert got.shape == (2, H, HD) and paged.lengths == {0: 11, 1: 21}
    paged.append([1], _rows(cp, 12), _rows(cp, 12), [12])
    assert paged.lengths[1] == 33 and paged.tables[1] == [1, 2, 3] \
        and paged.free_blocks == list(range(NB - 1, 3, -1))
    assert slots.decode(cp.empty((3, H, HD)), _rows(cp, 3), _rows(cp, 3), [1, 2, 3]).shape \
        == (3, H, HD)
    names = [x[0] for x in cp.launched[first:]]
    assert len(names) == 3 + 3 + 3 + 3 + 1 + 3 and all("validate" not in n for n in names)
