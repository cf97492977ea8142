"""What a bad-input campaign over the runtime left: each bad argument below is a
ContractError (never a TypeError, KeyError or AttributeError), raised before any state
change -- no length advanced, no block taken, nothing allocated, uploaded or launched.
CPU only: CuPy is kgen.testing.fakecupy's Guarded, armed for the call to record every
allocation, upload, fill and launch."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from kgen import ops
from kgen.ir.axes import IoDtype, Lse, Op, SeqStarts
from kgen.ir.geometry import MLA_HEADS, MLA_LATENT, MLA_PREFILL_QK, MLA_PREFILL_V, MLA_ROPE, MLA_ROW
from kgen.ir.params import INT_MAX
from kgen.ir.target import TARGET
from kgen.runtime import ContractError, convention, tuned
from kgen.runtime import mla as rmla
from kgen.runtime.kv import KVCache, SlotKVCache
from kgen.runtime.mla import MLACache
from kgen.runtime.options import Options
from kgen.runtime.paged import PagedKVCache
from kgen.runtime.select import find
from kgen.testing.built import needs_build
from kgen.testing.fakecupy import FakeArray, Guarded

pytestmark = needs_build
HK, H, HD, MS = 2, 4, 256, 64  # KV heads, q heads, head_dim, max_seq
NB, BS = 8, 16  # paged: blocks, positions per block


@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(tuned, "tuned", lambda *a: None)
    monkeypatch.setattr(tuned, "tuned_prefill", lambda *a: None)
    monkeypatch.setattr(rmla, "_CHOSEN", {})
    return Guarded().install(monkeypatch)


def _state(cache) -> tuple:
    """What a refused call must leave as it was."""
    if isinstance(cache, PagedKVCache | MLACache):
        return (copy.deepcopy(cache.tables), dict(cache.lengths), list(cache.free_blocks),
                cache._next)
    if isinstance(cache, SlotKVCache):
        return (cache.scratch.m, cache.k, cache.v, cache.shadows)
    if isinstance(cache, KVCache):
        return (cache.length, cache.last_prefill, cache.last_plan, cache._pos,
                cache.scratch.m, dict(cache._steps), dict(cache._default_plans))
    return ()  # a call with no object: only what the fake records


def refused(cp, cache, match: str, fn, *a, **kw) -> ContractError:
    """``fn(*a, **kw)`` is a ContractError matching ``match`` that touched nothing on the
    GPU and left ``cache`` as it was; returns the error."""
    got = []

    def call():
        try:
            fn(*a, **kw)
        except ContractError as e:
            got.append(e)
            raise
    cp.refuses(lambda: _state(cache), match, call)
    return got[0]


def _rows(cp, n, heads=HK):
    return cp.empty((n, heads, HD))


@pytest.fixture
def dense(cp):
    """An f32 cache holding 10 rows."""
    c = KVCache(HK, HD, MS, kv="f32")
    c.prefill(cp.empty((10, H, HD)), _rows(cp, 10), _rows(cp, 10), pos0=0)
    assert c.length == 10
    return c


@pytest.fixture
def paged(cp):
    """An f32 paged cache of one sequence holding 10 rows."""
    c = PagedKVCache(NB, BS, HK, HD, kv="f32")
    sid = c.add()
    c.append([sid], _rows(cp, 10), _rows(cp, 10), [10])
    return c


@pytest.fixture
def latent(cp):
    """An f32 latent cache of one sequence holding 3 rows."""
    c = MLACache(NB, BS)
    sid = c.add()
    c.store([sid], cp.empty((3, MLA_LATENT)), cp.empty((3, MLA_ROPE)), [3])
    return c


# ---- 1. a bad stream, refused before the call appends or launches --------------------

def _stream_calls(cp, dense, paged, latent):
    """(the cache, the call, its arguments) of each cache call that takes a stream."""
    slots = SlotKVCache(2, HK, HD, MS, kv="f32")
    q6, r6 = cp.empty((6, H, HD)), _rows(cp, 6)
    return {
        "KVCache.prefill": (dense, dense.prefill, (q6, r6, r6, 10)),
        "KVCache.decode": (dense, dense.decode, (cp.empty((H, HD)), _rows(cp, 1),
                                                 _rows(cp, 1), 10)),
        "KVCache.append": (dense, dense.append, (r6, r6, 10)),
        "SlotKVCache.prefill": (slots, slots.prefill, (0, q6, r6, r6, 0)),
        "PagedKVCache.prefill": (paged, paged.prefill, ([0], q6, r6, r6, [6])),
        "MLACache.store": (latent, latent.store, ([0], cp.empty((2, MLA_LATENT)),
                                                  cp.empty((2, MLA_ROPE)), [2])),
    }


@pytest.mark.parametrize("bad", ["x", 1.5, -1, True, object()])
@pytest.mark.parametrize("name", ["KVCache.prefill", "KVCache.decode", "KVCache.append",
                                  "SlotKVCache.prefill", "PagedKVCache.prefill",
                                  "MLACache.store"])
def test_a_bad_stream_is_refused_before_the_call_appends(cp, dense, paged, latent, name, bad):
    cache, fn, args = _stream_calls(cp, dense, paged, latent)[name]
    e = refused(cp, cache, "stream must be", fn, *args, stream=bad)
    assert e.contract == "stream"


# ---- 2. plan's group count: a positive integer ------------------------------------------

@pytest.mark.parametrize("plan", [{}, {"kps": 16, "splits_cap": 4}])
@pytest.mark.parametrize("groups", [1.5, 0, -2, True, "2", None, np.float32(2)])
def test_plan_refuses_a_group_count_that_is_no_positive_integer(cp, dense, groups, plan):
    e = refused(cp, dense, "groups must be an integer", dense.plan, groups, **plan)
    assert e.contract == "range"


# ---- 3. what raised TypeError, KeyError or AttributeError ------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda: KVCache(HK, HD, MS, kv=None), "kv must be one of"),
    (lambda: KVCache(HK, HD, MS, kv=["f32"]), "kv must be one of"),
    (lambda: KVCache(HK, HD, MS, kv="f32", v_kv=3), "v_kv must be one of"),
    (lambda: SlotKVCache(2, HK, HD, MS, kv=None), "kv must be one of"),
    (lambda: PagedKVCache(NB, BS, HK, HD, kv=None), "kv must be one of"),
])
def test_a_cache_format_that_is_no_format_name_is_refused(cp, make, match):
    cp.armed = True
    with pytest.raises(ContractError, match=match):
        make()
    assert cp.touched == [], f"allocated before refusing: {cp.touched}"


@pytest.mark.parametrize("opts", ["x", {}, 0, (None,)])
def test_plan_refuses_opts_that_are_no_options(cp, dense, opts):
    e = refused(cp, dense, "opts must be", dense.plan, 2, opts=opts)
    assert e.contract == "type"
    assert dense.plan(2, opts=Options.checked(H, 0, 0, None, None, 0.0, None, True))


@pytest.mark.parametrize("call, match", [
    (lambda p, m, a: p.prefill([0], a["q"], a["r"], a["r"], None),
     "rows must list one count per sequence"),
    (lambda p, m, a: p.append([0], a["r"], a["r"], None),
     "rows must list one count per sequence"),
    (lambda p, m, a: p.prefill([0], a["q"], a["r"], a["r"], 6), "rows must list"),
    (lambda p, m, a: m.store([0], a["kv_c"], a["k_pe"], None),
     "rows must list one count per sequence"),
    (lambda p, m, a: m.gather([0], 0), "starts must list one count per sequence"),
])
def test_rows_that_list_no_counts_are_refused_before_any_change(cp, paged, latent, call,
                                                                match):
    a = {"q": cp.empty((6, H, HD)), "r": _rows(cp, 6), "kv_c": cp.empty((6, MLA_LATENT)),
         "k_pe": cp.empty((6, MLA_ROPE))}
    cp.refuses(lambda: (_state(paged), _state(latent)), match, call, paged, latent, a)


def _unbound_calls(cp, dense, paged):
    """(the cache, the call, arguments, keywords, what the refusal names) of calls whose
    arguments do not bind: CuPy callers (the convention's fast path), a stream named, a
    16-bit q widened (which allocates), a forwarding call and an entry point."""
    slots = SlotKVCache(2, HK, HD, MS, kv="f32")
    q6, r6 = cp.empty((6, H, HD)), _rows(cp, 6)
    half = cp.empty((6, H, HD), np.float16)
    s = cp.cuda.Stream()
    latent = (cp.empty((2, MLA_LATENT)), cp.empty((2, MLA_ROPE)), cp.empty((NB, BS, MLA_ROW)),
              cp.asarray(np.array([0, 1], np.int64)))
    return {
        "slot prefill, unknown keyword": (slots, slots.prefill, (0, q6, r6, r6, 0),
                                          {"nosuch": 1}, "nosuch"),
        "prefill, unknown keyword": (dense, dense.prefill, (q6, r6, r6, 10), {"nosuch": 1},
                                     "nosuch"),
        "prefill, stream named": (dense, dense.prefill, (q6, r6, r6, 10),
                                  {"nosuch": 1, "stream": s}, "nosuch"),
        "prefill, q widened": (dense, dense.prefill, (half, r6, r6, 10), {"nosuch": 1},
                               "nosuch"),
        "prefill, q widened, pos0 missing": (dense, dense.prefill, (half, r6, r6), {},
                                             "pos0"),
        "prefill, q twice": (dense, dense.prefill, (q6, r6, r6, 10), {"q": q6}, "'q'"),
        "append, out": (dense, dense.append, (r6, r6, 10), {"out": q6}, "'out'"),
        "decode, too many": (dense, dense.decode, (cp.empty((H, HD)), _rows(cp, 1),
                                                   _rows(cp, 1), 10, *([None] * 10)), {},
                             "too many"),
        "paged decode, k_new missing": (paged, paged.decode, ([0], cp.empty((1, H, HD))), {},
                                        "k_new"),
        "concat_and_cache_mla, unknown keyword": (None, rmla.concat_and_cache_mla, latent,
                                                  {"validate_pos": False}, "validate_pos"),
    }


@pytest.mark.parametrize("name", ["slot prefill, unknown keyword", "prefill, unknown keyword",
                                  "prefill, stream named", "prefill, q widened",
                                  "prefill, q widened, pos0 missing", "prefill, q twice",
                                  "append, out", "decode, too many",
                                  "paged decode, k_new missing",
                                  "concat_and_cache_mla, unknown keyword"])
def test_arguments_that_do_not_bind_are_refused_before_any_change(cp, dense, paged,
                                                                  monkeypatch, name):
    """Python's TypeError (an unknown keyword, one too many, missing or given twice) is a
    ContractError naming the argument, before anything is converted: a 16-bit q is not
    widened first."""
    cache, fn, args, kw, names = _unbound_calls(cp, dense, paged)[name]
    widened = []  # the 16-bit arrays widened (float32 ones pass through as they are)
    monkeypatch.setattr(convention, "widen",
                        lambda a: (a.dtype != np.float32 and widened.append(a)) or a)
    e = refused(cp, cache, names, fn, *args, **kw)
    assert e.contract == "signature" and widened == []


# ---- 4. validate: True, False or None ------------------------------------------------------

def _entry_calls(cp):
    """A call of each entry point that takes validate, good but for validate."""
    up = lambda x: cp.asarray(np.asarray(x))  # noqa: E731
    cache = cp.empty((NB, BS, MLA_ROW))
    Tq, Tk, Hp = 9, 20, 4
    return {
        "concat_and_cache_mla": (rmla.concat_and_cache_mla, (
            cp.empty((2, MLA_LATENT)), cp.empty((2, MLA_ROPE)), cache,
            up(np.array([0, 5], np.int64)))),
        "mla_prefill_attention": (rmla.mla_prefill_attention, (
            cp.empty((Tq, Hp, MLA_PREFILL_V)), None, cp.empty((Tq, Hp, MLA_PREFILL_QK)),
            cp.empty((Tk, Hp, MLA_PREFILL_QK)), cp.empty((Tk, Hp, MLA_PREFILL_V)),
            up(np.array([0, 4, 9], np.int32)), up(np.array([0, 10, 20], np.int32)), 0.07,
            True, 5)),
        "gather_mla_cache": (rmla.gather_mla_cache, (
            cp.empty((4, MLA_ROW)), cache, up(np.zeros((1, 4), np.int32)),
            up(np.array([0, 4], np.int32)), up(np.zeros(4, np.int32)), None, 4)),
        "mla_decode_attention": (rmla.mla_decode_attention, (
            cp.empty((1, 16, MLA_LATENT)), None, cp.empty((1, 16, MLA_ROW)), cache,
            up(np.zeros((1, 2), np.int32)), up(np.array([3], np.int32)), 0.1)),
    }


@pytest.mark.parametrize("bad", [1, 0, "yes", 1.0, [], "False"])
@pytest.mark.parametrize("name", ["concat_and_cache_mla", "mla_prefill_attention",
                                  "gather_mla_cache", "mla_decode_attention"])
def test_validate_is_true_false_or_none(cp, name, bad):
    fn, args = _entry_calls(cp)[name]
    e = refused(cp, None, "validate must be True, False or None", fn, *args, validate=bad)
    assert e.contract == "type"
    for good in (True, False, None):  # the same call, validate as the convention spells it
        n = len(cp.launched)
        fn(*args, validate=good)
        assert len(cp.launched) > n


# ---- 5. the MLA decode's grids, against the target's limits ------------------------------

def test_mla_decode_launches_within_the_grid_limits_and_is_refused_past_them(cp, latent):
    """100,000 q heads is within every limit: the decode's grid is (head groups, splits,
    requests), the combine's (requests x heads); both are checked against TARGET (as every
    launch is, kgen.runtime.bind), and the kernels index in size_t. Past the limits -- more
    request heads than the combine's int row index, more heads than the C int n_head, more
    requests than grid.z holds -- the call is refused before it stores a row."""
    heads = 100_000
    kv_c, k_pe = cp.empty((1, MLA_LATENT)), cp.empty((1, MLA_ROPE))
    n = len(cp.launched)
    latent.decode([0], cp.empty((1, heads, MLA_ROW)), kv_c, k_pe)
    grids = {name: grid for name, grid, *_ in cp.launched[n:]}
    decode, combine = _named(Op.MLA_DECODE), _named(Op.MLA_COMBINE, lse=Lse.NONE.value)
    assert grids[decode] == (math.ceil(heads / MLA_HEADS), 1, 1)
    assert grids[combine] == (heads, 1, 1)
    for x, y, z in grids.values():
        assert 1 <= x <= TARGET.grid_x_max and y <= TARGET.grid_yz_max and \
            z <= TARGET.grid_yz_max
    assert latent.lengths[0] == 4
    one = latent.add()
    rows2 = cp.empty((2, MLA_LATENT)), cp.empty((2, MLA_ROPE))
    refused(cp, latent, "int32 index", latent.decode, [0, one],
            FakeArray((2, 2**30, MLA_ROW)), *rows2)  # the combine's rows: 2**31, one too many
    refused(cp, latent, f"n_head = {INT_MAX + 1} is outside a C int", latent.decode, [0],
            FakeArray((1, INT_MAX + 1, MLA_ROW)), kv_c, k_pe)  # the decode's n_head
    B = TARGET.grid_yz_max + 1  # requests: the decode's grid.z
    e = refused(cp, None, f"exceeds {TARGET.grid_yz_max}", rmla.mla_decode_attention,
                FakeArray((B, 16, MLA_LATENT)), None, FakeArray((B, 16, MLA_ROW)),
                cp.empty((NB, BS, MLA_ROW)), FakeArray((B, 1), np.int32),
                FakeArray((B,), np.int32), 0.1, validate=False)
    assert e.contract == "grid"


# ---- 6. a cache that cannot work, refused at construction --------------------------------

def _named(op: Op, in_dtype: IoDtype = IoDtype.F32, **needs) -> str:
    """The name of the kernel an f32 cache's call of ``op`` chooses (in_dtype: another)."""
    r = rmla.role(op, in_dtype, **needs)
    return find(r, ops.get(op).mla_width())[0].name


@pytest.mark.parametrize("make, match", [
    (lambda: MLACache(NB, BS, variants={"store": "nosuch"}),
     r"variants\['store'\] = 'nosuch': no generated kernel 'nosuch'"),
    (lambda: MLACache(NB, BS, variants={"decode": _named(Op.MLA_STORE)}),
     r"variants\['decode'\] = .*cannot serve"),
    (lambda: MLACache(NB, BS, variants={"store": _named(Op.MLA_STORE, IoDtype.BF16)}),
     r"variants\['store'\] = .*cannot serve"),
    (lambda: MLACache(NB, BS, variants={"combine": "nosuch"}), r"variants\['combine'\]"),
    (lambda: MLACache(NB, BS, variants="store"), "variants maps a role"),
    (lambda: MLACache(NB, BS, max_blocks_per_seq=NB + 1), "max_blocks_per_seq"),
    (lambda: PagedKVCache(NB, BS, HK, HD, kv="f32", max_blocks_per_seq=NB + 1),
     "max_blocks_per_seq"),
])
def test_a_cache_that_cannot_work_is_refused_at_construction(cp, make, match):
    cp.armed = True
    with pytest.raises(ContractError, match=match):
        make()
    assert cp.touched == [], f"allocated before refusing: {cp.touched}"


def test_variants_that_serve_the_cache_are_taken_and_used(cp):
    """Named kernels that serve the cache pass the construction's check and run."""
    variants = {"store": _named(Op.MLA_STORE), "decode": _named(Op.MLA_DECODE),
                "gather": _named(Op.MLA_GATHER, seq_starts=SeqStarts.NONE.value),
                "combine": _named(Op.MLA_COMBINE, lse=Lse.NONE.value)}
    c = MLACache(NB, BS, max_blocks_per_seq=NB, variants=variants)
    sid = c.add()
    c.store([sid], cp.empty((3, MLA_LATENT)), cp.empty((3, MLA_ROPE)), [3])
    c.decode([sid], cp.empty((1, 16, MLA_ROW)), cp.empty((1, MLA_LATENT)),
             cp.empty((1, MLA_ROPE)))
    c.gather([sid])
    assert [x[0] for x in cp.launched[-5:]] == [variants[k] for k in (
        "store", "store", "decode", "combine", "gather")]
