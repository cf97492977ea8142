"""The generated C++ op-level entry points (kgen::ops in generated/kgen_launch.hpp) answer
as the Python runtime does, with no GPU: the kernel choice (kgen.runtime.select.find)
over every role, format, head_dim, group count, option set and layout constraint; and
whole ops (kgen.runtime.kv.KVCache prefill and decode, kgen.runtime.paged.PagedKVCache
store, prefill and decode) as launch sequences: the same kernels in the same order with
the same grid, block, shared memory and parameters (the decode plan from the SM count,
the given plan, or a tune store's), or the same refusal with the same message.

The Python side runs on kgen.testing.fakecupy (its launches recorded), the C++ side
through tests/cpp/kgen_ops_shim.cpp (a C ABI, loaded with ctypes) in plan mode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kgen.formats import FORMATS
from kgen.runtime import device, options, tuned
from kgen.runtime.contracts import ContractError
from kgen.runtime.kv import KVCache
from kgen.runtime.paged import PagedKVCache
from kgen.runtime.roles import ROLES
from kgen.runtime.select import Role, find, generated
from kgen.testing.built import BUILT
from kgen.testing.cxx import build_shim, load_shim
from kgen.testing.cxx import call as shim_call
from kgen.testing.fakecupy import FakeArray, FakeCupy

SHIM = Path(__file__).resolve().parents[1] / "cpp" / "kgen_ops_shim.cpp"
SMS = 13  # FakeCupy's multiProcessorCount

pytestmark = [pytest.mark.toolchain,
              pytest.mark.skipif(BUILT is None, reason="no built kernels: run `kgen build "
                                 "specs/` (it writes generated/kgen_launch.hpp)")]


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    out = tmp_path_factory.mktemp("ops") / "libkgen_ops_shim.so"
    why = build_shim(SHIM, BUILT.root, out, ("-O1", "-Werror"))
    if why is not None and why.startswith("skip: "):
        pytest.skip(why[6:])
    assert why is None, why
    return load_shim(out)


def call(lib, fields: dict, run: int = 0, stream: int = 0) -> str:
    return shim_call(lib, fields, run, stream)[1]


# ---- the choice -----------------------------------------------------------------------

NEEDS = [(), (("window", "exact"),), (("softcap", "tanh"),), (("mask", "full"),),
         (("sinks", "learned"),), (("window", "exact"), ("softcap", "tanh")),
         (("window", "exact"), ("sinks", "learned"))]


def test_choice_answers_as_python(shim):
    pool = generated()
    lines = 0
    wrong = []
    for role, base in ROLES.items():
        bound = base.op.name in ("FLASH", "KV_APPEND")
        for kv in sorted(FORMATS):
            for needs in NEEDS:
                for hd in (32, 64, 96, 128, 256, 512):
                    for g in (1, 2, 4, 8, 16):
                        for where in (None, (256, 8, None), (None, None, 16)):
                            r = Role(base.op, base.position, base.mode,
                                     kv if bound else None, needs)

                            def w(k, where=where):
                                return all(v is None or getattr(k, a) == v for a, v in
                                           zip(("ring_rows", "sink_rows", "tile_keys"),
                                               where or (None,) * 3, strict=True))
                            try:
                                want = "OK\t" + find(r, hd, g, None, w if where else None,
                                                     pool)[0].name
                            except ContractError as exc:
                                want = f"ERR\t1\t{exc.contract}\t{exc}"
                            ring, sink, tile = where or (None, None, None)
                            got = call(shim, {"op": "choose", "role": role, "kv": kv,
                                              "head_dim": hd, "groups": g,
                                              "needs": ",".join(f"{a}={v}" for a, v in needs),
                                              "ring_rows": ring, "sink_rows": sink,
                                              "tile_keys": tile})
                            lines += 1
                            if got != want:
                                wrong.append(f"{r} hd={hd} g={g} where={where}\n  python: "
                                             f"{want}\n  c++:    {got}")
    assert not wrong, f"{len(wrong)} of {lines} choices differ:\n" + "\n".join(wrong[:10])
    print(f"{lines} choices compared")


def test_variant_answers_as_python(shim):
    """A named kernel: served, refused for its role, its shape or its layout."""
    pool = generated()
    names = [k.name for k, _ in pool][::7] + ["no_such_kernel"]
    wrong, n = [], 0
    for role in ("prefill", "decode", "decode_dev", "append", "combine", "prefill_paged"):
        base = ROLES[role]
        for name in names:
            for hd, where in ((128, None), (256, (256, 8, None)), (64, (512, 8, None))):
                r = Role(base.op, base.position, base.mode, "f32" if base.op.name in
                         ("FLASH", "KV_APPEND") else None)

                def w(k, where=where):
                    return (k.ring_rows, k.sink_rows) == where[:2]
                try:
                    want = "OK\t" + find(r, hd, 2, name, w if where else None, pool)[0].name
                except ContractError as exc:
                    want = f"ERR\t1\t{exc.contract}\t{exc}"
                ring, sink, _ = where or (None, None, None)
                got = call(shim, {"op": "choose", "role": role, "kv": "f32", "head_dim": hd,
                                  "groups": 2, "ring_rows": ring, "sink_rows": sink,
                                  "variant": name})
                n += 1
                if got != want:
                    wrong.append(f"{role} {name} hd={hd}\n  python: {want}\n  c++:    {got}")
    assert not wrong, f"{len(wrong)} of {n} differ:\n" + "\n".join(wrong[:10])


# ---- whole ops, as launch sequences -----------------------------------------------------

@pytest.fixture
def cp(monkeypatch, tmp_path):
    monkeypatch.setattr(device, "_SMS", {})
    monkeypatch.setattr(tuned, "_loaded", {})
    monkeypatch.setattr(tuned, "current_device", lambda: ("kgen fake GPU", 13000))
    monkeypatch.setenv("KGEN_TUNE_DIR", str(tmp_path / "tune"))
    monkeypatch.setattr(options, "_NO_SINKS", {})
    return FakeCupy().install(monkeypatch)


class Labels:
    """Which buffer a pointer lies in: the caller's (by name) or one Python made."""

    def __init__(self):
        self.spans: list[tuple[int, int, str]] = []

    def add(self, name: str, a) -> tuple[int, tuple]:
        if a is None:
            return None
        self.spans.append((a.data.ptr, a.data.ptr + max(a.size, 1) * a.dtype.itemsize, name))
        return (a.data.ptr, a.shape)

    def of(self, ptr: int) -> str:
        for lo, hi, name in self.spans:
            if lo <= ptr < hi:
                return name
        return "made"


SCRATCH = ("m", "l", "acc")
MADE = {"out", "m", "l", "acc", "pos_dev", "neutral", "made"}
SEEN: dict[str, int] = {}  # outcomes compared, by kind (printed, and checked below)


def python_launches(cp, labels: Labels, n0: int) -> list[tuple]:
    out = []
    for name, grid, block, args, smem, _ in cp.launched[n0:]:
        ps = []
        for v in args:
            if isinstance(v, FakeArray):
                lab = labels.of(v.data.ptr)
                ps.append(("T", lab, None if lab in MADE else tuple(v.shape)))
            elif isinstance(v, np.floating):
                ps.append(("F", float(np.float32(v))))
            else:
                ps.append(("I", int(v)))
        out.append((name, tuple(grid), tuple(block), int(smem), tuple(ps)))
    return out


def cpp_launches(reply: str, labels: Labels) -> tuple[tuple, list[tuple]]:
    lines = reply.split("\n")
    head = lines[0].split("\t")
    out = []
    for line in lines[1:]:
        f = line.split("\t")
        ps = []
        for p in f[6:]:
            kind, _, rest = p.partition(":")
            if kind == "T":
                ptr, _, dims = rest.partition(":")
                lab = "neutral" if int(ptr) == 0 else labels.of(int(ptr))
                lab = "made" if lab in ("block_table", "seq_lens", "query_start_loc",
                                        "slot_mapping") else lab  # Python's uploads
                ps.append(("T", lab, None if lab in MADE else
                           tuple(int(d) for d in dims.split(",") if d)))
            elif kind == "F":
                ps.append(("F", float(np.float32(float(rest)))))
            else:
                ps.append(("I", int(rest)))
        grid = tuple(int(x) for x in f[1].split(","))
        block = tuple(int(x) for x in f[2].split(","))
        out.append((f[0], grid, block, int(f[3]), tuple(ps)))
    return tuple(head[1:]), out


def python_labels(labels: Labels, made: dict) -> Labels:
    """Python-made arrays, labelled as the C++ caller's buffer of the same role."""
    for name, a in made.items():
        if a is not None:
            labels.spans.insert(0, (a.data.ptr, a.data.ptr + max(a.size, 1) * a.dtype.itemsize,
                                    name))
    for a in options._NO_SINKS.values():
        labels.spans.insert(0, (a.data.ptr, a.data.ptr + a.size * 4, "neutral"))
    return labels


def _opts(o: dict, prefill: bool) -> dict:
    """Python keywords and the shim's fields of one option set."""
    py, c = {}, {}
    if "scale" in o:
        py["scale"] = c["scale"] = o["scale"]
    if "window" in o:
        py["window_size"] = o["window"]
        c["window_left"], c["window_right"] = o["window"]
    if "softcap" in o:
        py["softcap"] = c["logits_soft_cap"] = o["softcap"]
    if o.get("causal") is False and prefill:
        py["causal"] = c["causal"] = False
    if "attn_win" in o:
        py["attn_win"] = c["attn_win"] = o["attn_win"]
    return py, c


OPTION_SETS = [{}, {"scale": 0.07}, {"window": (40, 0)}, {"softcap": 30.0},
               {"causal": False}, {"sinks": True}, {"window": (2147483647, 0)},
               {"window": (16, 3), "softcap": 20.0}]


def _dense_case(cp, lib, kv, hd, hk, g, mode, n, pos, opt, shadows=(0, 0), plan=None,
                store=None):
    """One dense op on both sides: the same refusal, or the same launches."""
    max_seq = 512
    sink, win = shadows
    try:
        cache = KVCache(hk, hd, max_seq, kv=kv, sink=sink, win=win)
    except ContractError as exc:  # the C++ op checks what the constructor does first
        return "refused", str(exc), call(lib, {"op": "attention", "kv": kv, "n_head_kv": hk,
                                               "head_dim": hd, "max_seq": max_seq,
                                               "sink": sink, "win": win})
    n_head = hk * g
    py, c = _opts(opt, mode == "prefill")
    sinks = cp.empty((n_head,)) if opt.get("sinks") else None
    labels = Labels()
    f = {"op": "attention", "kv": kv, "n_head_kv": hk, "head_dim": hd, "max_seq": max_seq,
         "k": labels.add("k", cache.k), "v": labels.add("v", cache.v),
         "sink": sink, "win": win, "sm_count": SMS, "tune_store": store, **c,
         "sinks": labels.add("sinks", sinks)}
    for s, a in zip(("k_sink", "v_sink", "k_win", "v_win"), cache.shadows, strict=False):
        f[s] = labels.add(s, a)
    if mode == "prefill":
        q, kn, vn = cp.empty((n, n_head, hd)), cp.empty((n, hk, hd)), cp.empty((n, hk, hd))
        out = FakeArray((n, n_head, hd))
    else:
        q, kn, vn = cp.empty((n_head, hd)), cp.empty((1, hk, hd)), cp.empty((1, hk, hd))
        out = FakeArray((n_head, hd))
    f.update(q=labels.add("q", q), k_new=labels.add("k_new", kn), v_new=labels.add("v_new", vn),
             out=(out.data.ptr, out.shape), pos=pos)
    cl = Labels()
    cl.spans = list(labels.spans)
    cl.add("out", out)
    for s in SCRATCH:  # a decode's partials, or a split prefill's (up to 16 splits a row)
        a = FakeArray((max(n_head * 1024, n * n_head * 16) * (hd if s == "acc" else 1),))
        f[s] = cl.add(s, a)
    pd = FakeArray((1,), np.int32)
    f["pos_dev"] = cl.add("pos_dev", pd)
    if plan:
        f["kps"], f["splits_cap"] = plan
        py["kps"], py["splits_cap"] = plan
    n0 = len(cp.launched)
    try:
        if mode == "prefill":
            res = cache.prefill(q, kn, vn, pos, sinks=sinks, **py)
        else:
            res = cache.decode(q, kn, vn, pos, sinks=sinks, **py)
    except ContractError as exc:
        return "python", str(exc), call(lib, f)
    # The caller's m, l and acc hold a decode's partials, and a split prefill's (Python:
    # the cache's own scratch for each; a decode past every decode's group bound is a
    # one-row prefill).
    by_prefill = mode == "prefill" or cache.last_plan[2] == "prefill"
    sc = cache.prefill_scratch if by_prefill else cache.scratch
    pl = python_labels(labels, {"out": res, "m": sc.m, "l": sc.l, "acc": sc.acc,
                                "pos_dev": cache._pos})
    want = python_launches(cp, pl, n0)
    source = cache.last_plan[2] if mode == "decode" else ""
    return "python", (want, source, cache.last_plan), call(lib, f), cl


def _compare(lib, outcome, wrong, label):
    kind, want, got, *rest = (*outcome, None)[:4] if len(outcome) == 3 else outcome
    if kind == "refused":  # the cache itself refused (its constructor): C++ at the call
        SEEN["cache refused"] = SEEN.get("cache refused", 0) + 1
        if got.split("\t", 3)[-1] != want:
            wrong.append(f"{label} (the cache)\n  python: {want}\n  c++:    {got}")
        return
    SEEN["refusals" if isinstance(want, str) else "launch sequences"] = \
        SEEN.get("refusals" if isinstance(want, str) else "launch sequences", 0) + 1
    if isinstance(want, str):
        if got.split("\t", 3)[-1] != want:
            wrong.append(f"{label}\n  python: {want}\n  c++:    {got}")
        return
    launches, source, plan = want
    if not got.startswith("OK"):
        wrong.append(f"{label}\n  python: {len(launches)} launches\n  c++:    {got}")
        return
    head, mine = cpp_launches(got, rest[0])
    if mine != launches:
        first = next((i for i, (a, b) in enumerate(zip(mine, launches, strict=False)) if a != b),
                     min(len(mine), len(launches)))
        wrong.append(f"{label}: launch {first} differs\n  python: "
                     f"{launches[first] if first < len(launches) else None}\n  c++:    "
                     f"{mine[first] if first < len(mine) else None}")
    elif plan is not None and source:
        SEEN[f"plan {source}"] = SEEN.get(f"plan {source}", 0) + 1
        if head[2] != source:
            wrong.append(f"{label}: plan source {head} vs {plan}")


def _past_every_decode() -> int:
    """One group past every decode's bound: KVCache.decode runs a one-row prefill there."""
    return 1 + max(k.max_groups for k, _ in generated()
                   if k.op.name == "FLASH" and k.mode.name == "DECODE")


def test_dense_ops_launch_as_python(shim, cp):
    SEEN.clear()
    wrong, n = [], 0
    for kv in sorted(FORMATS):
        shadows = (4, 64) if FORMATS[kv].shadows else (0, 0)
        for hd in (64, 128, 256):
            for g in (1, 4, _past_every_decode()):
                for opt in OPTION_SETS:
                    for mode, rows, pos in (("prefill", 7, 0), ("prefill", 200, 30),
                                            ("decode", 1, 9), ("decode", 1, 400)):
                        if mode == "decode" and opt.get("causal") is False:
                            continue
                        out = _dense_case(cp, shim, kv, hd, 2, g, mode, rows, pos, opt,
                                          shadows)
                        n += 1
                        _compare(shim, out, wrong, f"{kv} hd={hd} g={g} {mode} n={rows} "
                                 f"pos={pos} {opt}")
    assert not wrong, f"{len(wrong)} of {n} ops differ:\n" + "\n".join(wrong[:8])
    print(f"{n} dense ops compared: {SEEN}")
    assert SEEN.get("launch sequences", 0) > n // 2 and SEEN.get("refusals", 0) > 0, SEEN


def test_dense_plans_given_and_tuned(shim, cp, tmp_path):
    """A given plan, and a tune store's plan and variant (stale entries ignored)."""
    SEEN.clear()
    wrong, n = [], 0
    pool = generated()
    path = tuned.cache_path("kgen fake GPU", 13000)
    choices = {}
    for kv in ("f32", "q8_0", "fp8_e4m3"):
        decodes = [k for k, _ in pool if k.op.name == "FLASH" and k.mode.name == "DECODE"
                   and k.position.name == "HOST" and k.kv.value == kv]
        for i, k in enumerate(decodes[:3]):
            key = tuned.shape_key(kv, 128, 4, 900 + 2000 * i)
            choices[key] = tuned.Choice(k.name, tuned.module_sha(k.name), 32 + i, 3 + i, 1.0)
        prefills = [k for k, _ in pool if k.op.name == "FLASH" and k.mode.name == "PREFILL"
                    and k.position.name == "HOST" and k.kv.value == kv]
        choices[tuned.prefill_key(kv, 128, 4, 7)] = tuned.Choice(
            prefills[-1].name, tuned.module_sha(prefills[-1].name), 0, 0, 1.0)
    stale = tuned.shape_key("f16", 128, 4, 100)
    choices[stale] = tuned.Choice(decodes[0].name, "0" * 64, 7, 7, 1.0)
    tuned.save("kgen fake GPU", 13000, choices)
    assert path.is_file()
    for kv in ("f32", "q8_0", "fp8_e4m3", "f16"):
        for pos in (9, 1500, 2500, 5000):
            for plan in (None, (64, 5), (16, 1)):
                out = _dense_case(cp, shim, kv, 128, 2, 4, "decode", 1, pos % 512, {},
                                  plan=plan, store=str(path)) if pos < 512 else \
                    _dense_tuned_long(cp, shim, kv, pos, plan, str(path))
                n += 1
                _compare(shim, out, wrong, f"{kv} pos={pos} plan={plan}")
        out = _dense_case(cp, shim, kv, 128, 2, 4, "prefill", 7, 0, {}, store=str(path))
        n += 1
        _compare(shim, out, wrong, f"{kv} tuned prefill")
    assert not wrong, f"{len(wrong)} of {n} differ:\n" + "\n".join(wrong[:8])
    print(f"{n} given/tuned plans compared: {SEEN}")
    assert min(SEEN.get(f"plan {s}", 0) for s in ("given", "tuned", "default")) > 0, SEEN


def _dense_tuned_long(cp, lib, kv, pos, plan, store):
    """A decode at a long position (a cache of 8192 rows): the tuned buckets."""
    hk, hd, g, max_seq = 2, 128, 4, 8192
    cache = KVCache(hk, hd, max_seq, kv=kv)
    labels = Labels()
    q, kn, vn = cp.empty((hk * g, hd)), cp.empty((1, hk, hd)), cp.empty((1, hk, hd))
    out = FakeArray((hk * g, hd))
    f = {"op": "attention", "kv": kv, "n_head_kv": hk, "head_dim": hd, "max_seq": max_seq,
         "k": labels.add("k", cache.k), "v": labels.add("v", cache.v), "sm_count": SMS,
         "tune_store": store, "q": labels.add("q", q), "k_new": labels.add("k_new", kn),
         "v_new": labels.add("v_new", vn), "out": (out.data.ptr, out.shape), "pos": pos}
    cl = Labels()
    cl.spans = list(labels.spans)
    cl.add("out", out)
    for s in SCRATCH:
        f[s] = cl.add(s, FakeArray((hk * g * 1024 * (hd if s == "acc" else 1),)))
    f["pos_dev"] = cl.add("pos_dev", FakeArray((1,), np.int32))
    py = {}
    if plan:
        f["kps"], f["splits_cap"] = plan
        py = {"kps": plan[0], "splits_cap": plan[1]}
    n0 = len(cp.launched)
    res = cache.decode(q, kn, vn, pos, **py)
    pl = python_labels(labels, {"out": res, "m": cache.scratch.m, "l": cache.scratch.l,
                                "acc": cache.scratch.acc, "pos_dev": cache._pos})
    return "python", (python_launches(cp, pl, n0), cache.last_plan[2], cache.last_plan), \
        call(lib, f), cl


def _paged_case(cp, lib, kv, hd, hk, g, mode, rows, opt, plan=None):
    nb, bs = 64, 16
    try:
        cache = PagedKVCache(nb, bs, hk, hd, kv=kv, max_blocks_per_seq=16)
    except ContractError as exc:  # the C++ op checks what the constructor does first
        return "refused", str(exc), call(lib, {"op": "paged_store", "kv": kv, "n_head_kv": hk,
                                               "head_dim": hd})
    n_head = hk * g
    sids = [cache.add() for _ in rows]
    if mode == "decode":  # some context first
        cache.lengths.update({s: 5 + 37 * i for i, s in enumerate(sids)})
        for i, s in enumerate(sids):
            cache.tables[s] = [cache.free_blocks.pop() for _ in range(-(-(5 + 37 * i) // bs))]
    total = sum(rows) if mode == "prefill" else len(sids)
    q, kn, vn = (cp.empty((total, n_head, hd)), cp.empty((total, hk, hd)),
                 cp.empty((total, hk, hd)))
    py, c = _opts(opt, mode == "prefill")
    sinks = cp.empty((n_head,)) if opt.get("sinks") else None
    labels = Labels()
    base = {"kv": kv, "n_head_kv": hk, "head_dim": hd,
            "key_cache": labels.add("key_cache", cache.k),
            "value_cache": labels.add("value_cache", cache.v)}
    lens = [cache.lengths[s] + (r if mode == "prefill" else 1)
            for s, r in zip(sids, rows, strict=True)]
    labels.add("q", q), labels.add("k_new", kn), labels.add("v_new", vn)
    cl = Labels()
    cl.spans = list(labels.spans)
    up = {n: cl.add(n, FakeArray(shape, np.int32)) for n, shape in (
        ("slot_mapping", (total,)), ("block_table", (len(sids), 16)),
        ("seq_lens", (len(sids),)), ("query_start_loc", (len(sids) + 1,)))}
    out = FakeArray((total, n_head, hd))
    store = {"op": "paged_store", **base, "key": (kn.data.ptr, kn.shape),
             "value": (vn.data.ptr, vn.shape), "slot_mapping": up["slot_mapping"]}
    att = {"op": "paged_attention", **base, "q": (q.data.ptr, q.shape),
           "out": cl.add("out", out), "block_table": up["block_table"],
           "seq_lens": up["seq_lens"], "sm_count": SMS, **c,
           "max_query_len": max(rows) if mode == "prefill" else 1,
           "max_seq_len": max(lens)}
    if mode == "prefill":
        att["query_start_loc"] = up["query_start_loc"]
        att["sinks"] = labels.add("sinks", sinks)
        cl.spans.insert(0, labels.spans[-1]) if sinks is not None else None
        for s in SCRATCH:  # a split prefill's partials (up to 16 splits a row)
            att[s] = cl.add(s, FakeArray((total * n_head * 16 * (hd if s == "acc" else 1),)))
    else:
        if sinks is not None:
            tiled = FakeArray((len(sids), n_head))
            att["sinks"] = cl.add("made", tiled)
        for s in SCRATCH:
            att[s] = cl.add(s, FakeArray((len(sids) * n_head * 1024 * (hd if s == "acc" else 1),)))
    if plan:
        att["kps"], att["splits_cap"] = plan
        py["kps"], py["splits_cap"] = plan
    n0 = len(cp.launched)
    try:
        if mode == "prefill":
            res = cache.prefill(sids, q, kn, vn, rows, sinks=sinks, **py)
        else:
            res = cache.decode(sids, q, kn, vn, sinks=sinks, **py)
    except ContractError as exc:
        got = call(lib, store)
        if got.startswith("OK"):
            got = call(lib, att)
        return "python", str(exc), got
    sc = cache.scratch if mode == "decode" else cache.prefill_scratch  # a split prefill's
    made = {"out": res, "m": sc.m, "l": sc.l, "acc": sc.acc}
    want = python_launches(cp, python_labels(labels, made), n0)
    a, b = call(lib, store), call(lib, att)
    if not a.startswith("OK"):
        return "python", (want, "", None), a, cl
    if not b.startswith("OK"):
        return "python", (want, "", None), b, cl
    merged = a.split("\n")[1:] + b.split("\n")[1:]
    return "python", (want, "", None), "\n".join([b.split("\n")[0], *merged]), cl


def test_paged_ops_launch_as_python(shim, cp):
    SEEN.clear()
    wrong, n = [], 0
    for kv in sorted(FORMATS):
        for hd in (64, 128, 256):
            for g in (1, 4):
                for opt in OPTION_SETS:
                    for mode, rows in (("prefill", [3, 9]), ("prefill", [1, 1, 20]),
                                       ("decode", [1, 1, 1])):
                        if mode == "decode" and opt.get("causal") is False:
                            continue
                        for plan in ((None, (32, 4)) if mode == "decode" else (None,)):
                            out = _paged_case(cp, shim, kv, hd, 2, g, mode, rows, opt, plan)
                            n += 1
                            _compare(shim, out, wrong, f"{kv} hd={hd} g={g} {mode} {rows} "
                                     f"{opt} plan={plan}")
    assert not wrong, f"{len(wrong)} of {n} ops differ:\n" + "\n".join(wrong[:8])
    print(f"{n} paged ops compared: {SEEN}")
    assert SEEN.get("launch sequences", 0) > n // 2, SEEN


BAD = [  # (mode, options, shape change): refusals both sides must give alike
    ("prefill", {"scale": -1.0}, {}), ("prefill", {"softcap": -2.0}, {}),
    ("prefill", {"window": (4, 0), "attn_win": 16}, {}), ("decode", {"window": (-2, 0)}, {}),
    ("prefill", {"window": (0, -3)}, {}),
    ("prefill", {}, {"n_head": 3}), ("decode", {}, {"n_head": 5}),
    ("prefill", {}, {"pos": 510}), ("decode", {}, {"pos": 512}), ("decode", {}, {"pos": -1}),
    ("decode", {}, {"plan": (0, 4)}), ("decode", {}, {"plan": (16, 0)}),
    ("prefill", {"scale": float("inf")}, {}),
]


def test_dense_refusals_answer_as_python(shim, cp):
    wrong, n = [], 0
    for kv in ("f32", "q4", "fp8_e4m3"):
        for mode, opt, change in BAD:
            hk, hd, g = 2, 128, 2
            n_head = change.get("n_head", hk * g)
            out = _dense_refusal(cp, shim, kv, hk, hd, n_head, mode, opt,
                                 change.get("pos", 3), change.get("plan"))
            n += 1
            if out[0] != out[1]:
                wrong.append(f"{kv} {mode} {opt} {change}\n  python: {out[0]}\n  c++:    "
                             f"{out[1]}")
    assert not wrong, f"{len(wrong)} of {n} refusals differ:\n" + "\n".join(wrong[:8])


def _dense_refusal(cp, lib, kv, hk, hd, n_head, mode, opt, pos, plan):
    cache = KVCache(hk, hd, 512, kv=kv)
    py, c = _opts(opt, True)
    n = 4 if mode == "prefill" else 1
    q = cp.empty((n, n_head, hd)) if mode == "prefill" else cp.empty((n_head, hd))
    kn, vn = cp.empty((n, hk, hd)), cp.empty((n, hk, hd))
    f = {"op": "attention", "kv": kv, "n_head_kv": hk, "head_dim": hd, "max_seq": 512,
         "k": (cache.k.data.ptr, cache.k.shape), "v": (cache.v.data.ptr, cache.v.shape),
         "q": (q.data.ptr, q.shape), "k_new": (kn.data.ptr, kn.shape),
         "v_new": (vn.data.ptr, vn.shape), "out": (1, q.shape), "pos": pos, "sm_count": SMS,
         **c, "m": (2, (4096,)), "l": (3, (4096,)), "acc": (4, (4096 * hd,)),
         "pos_dev": (5, (1,))}
    for s, a in zip(("k_sink", "v_sink", "k_win", "v_win"), cache.shadows, strict=False):
        f[s] = (a.data.ptr, a.shape)
    if plan:
        f["kps"], f["splits_cap"] = plan
        py["kps"], py["splits_cap"] = plan
    try:
        (cache.prefill if mode == "prefill" else cache.decode)(q, kn, vn, pos, **py)
        want = "accepted"
    except ContractError as exc:
        want = str(exc)
    got = call(lib, f)
    return want, ("accepted" if got.startswith("OK") else got.split("\t", 3)[-1])
