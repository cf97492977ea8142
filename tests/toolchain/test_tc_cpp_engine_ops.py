"""The generated C++ entry points of the engine's ops beyond the caches (kgen::ops
merge_attn_states, concat_and_cache_mla, gather_mla_cache, mla_decode_attention,
mla_prefill_attention, dflash_block_attention, dflash_paged_block_attention) answer as
the Python entry points (kgen.runtime.merge, mla, dflash) do, with no GPU: the same
kernels launched in the same order with the same grid, block, shared memory and
parameters (each pointer the same buffer: the caller's by name, or the one Python made
and the C++ caller lent as scratch, by order of first use), or the same refusal with the
same message.

The cases are every generated test case of every kernel of those ops
(kgen.testing.testgen.cases, their arguments from kgen.testing.contracts.host_args),
each through the entry point both with the kernel named (variant) and chosen; the
refusals are every contract mutation of those kernels (kgen.testing.contracts) that a
kgen::Tensor can carry, and the entry points' own refusals. The Python side runs on
kgen.testing.fakecupy with validate = False (the C++ side reads no
device memory).

kgen::ops::slot_attention is kgen.runtime.kv.SlotKVCache's decode and prefill, compared
alike over every generated case of every per-slot decode kernel (the fake CuPy's slot
views lie at their offsets, as CuPy's do), with the positions its steps write into the
device position array checked against Python's upload."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kgen.ir.axes import IoDtype, Lse, Mask, Op
from kgen.ir.geometry import MLA_LATENT, MLA_ROPE, mla_default_splits
from kgen.ir.params import ENTRY_PARAMS, INT_MAX
from kgen.runtime import device, dflash, merge, mla
from kgen.runtime.contracts import ContractError
from kgen.runtime.select import generated
from kgen.testing.arguments import Placed
from kgen.testing.built import BUILT
from kgen.testing.contracts import MUTATIONS, ShapeOnly, host_args, mutations_for
from kgen.testing.cxx import build_shim, load_shim
from kgen.testing.cxx import call as shim_call
from kgen.testing.fakecupy import FakeArray, FakeCupy, _Ptr
from kgen.testing.testgen import cases

SHIM = Path(__file__).resolve().parents[1] / "cpp" / "kgen_ops_shim.cpp"
SMS = FakeCupy().cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
OPS = (Op.MERGE_ATTN_STATES, Op.MLA_STORE, Op.MLA_GATHER, Op.MLA_DECODE, Op.MLA_COMBINE,
       Op.MLA_PREFILL, Op.DFLASH_ATTENTION)
# Contracts a kgen::Tensor cannot carry (an element type, a Python object's type).
UNSEEN = {"dtype", "array", "type"}

pytestmark = [pytest.mark.toolchain,
              pytest.mark.skipif(BUILT is None, reason="no built kernels: run `kgen build "
                                 "specs/` (it writes generated/kgen_launch.hpp)")]


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine_ops") / "libkgen_ops_shim.so"
    why = build_shim(SHIM, BUILT.root, out, ("-O1", "-Werror"))
    if why is not None and why.startswith("skip: "):
        pytest.skip(why[6:])
    assert why is None, why
    return load_shim(out)


@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(device, "_SMS", {})
    for m in (merge, mla, dflash):
        monkeypatch.setattr(m, "_CHOSEN", {})
    return FakeCupy().install(monkeypatch)


def call(lib, fields: dict) -> str:
    """The shim's reply; a fake array goes as its address, shape and element strides."""
    def arg(v):
        if isinstance(v, FakeArray):
            item = v.dtype.itemsize
            return (v.data.ptr, v.shape, tuple(s // item for s in v.strides))
        return v
    return shim_call(lib, {n: arg(v) for n, v in fields.items()})[1]


def fake(x):
    """A host argument as a device array of the fake CuPy (shape, dtype, strides)."""
    if isinstance(x, np.ndarray):
        return FakeArray(x.shape, x.dtype, x.strides if x.ndim else None,
                         host=np.ascontiguousarray(x))
    if isinstance(x, ShapeOnly):
        return FakeArray(x.shape, x.dtype)
    if isinstance(x, Placed):  # at its own address
        return FakeArray(x.shape, x.dtype, data=_Ptr(0, x.data.ptr), host=x.host)
    return x


class Names:
    """Which argument a pointer is (by name), else the n-th buffer first seen that is
    none of them (Python's partials, the C++ caller's scratch)."""

    def __init__(self, named: dict):
        self.spans = [(a.data.ptr, a.data.ptr + max(a.size, 1) * a.dtype.itemsize, n)
                      for n, a in named.items() if isinstance(a, FakeArray)]
        self.new: dict[int, str] = {}

    def of(self, ptr: int) -> str:
        for lo, hi, name in self.spans:
            if lo <= ptr < hi:
                return name if ptr == lo else f"{name}+{ptr - lo}"
        return self.new.setdefault(ptr, f"new{len(self.new)}")


def py_launches(cp, names: Names, n0: int) -> list[tuple]:
    out = []
    for name, grid, block, args, smem, _ in cp.launched[n0:]:
        ps = []
        for v in args:
            if isinstance(v, FakeArray):
                ps.append(("T", names.of(v.data.ptr), tuple(v.shape)))
            elif isinstance(v, np.floating):
                ps.append(("F", float(np.float32(v))))
            else:
                ps.append(("I", int(v)))
        out.append((name, tuple(grid), tuple(block), int(smem), tuple(ps)))
    return out


def cpp_launches(reply: str, names: Names) -> list[tuple]:
    out = []
    for line in reply.split("\n")[1:]:
        f = line.split("\t")
        ps = []
        for p in f[6:]:
            kind, _, rest = p.partition(":")
            if kind == "T":
                ptr, _, dims = rest.partition(":")
                ps.append(("T", names.of(int(ptr)), tuple(int(d) for d in dims.split(",") if d)))
            elif kind == "F":
                ps.append(("F", float(np.float32(float(rest)))))
            else:
                ps.append(("I", int(rest)))
        out.append((f[0], tuple(int(x) for x in f[1].split(",")),
                    tuple(int(x) for x in f[2].split(",")), int(f[3]), tuple(ps)))
    return out


def scratch_for(a: dict, splits: int) -> dict:
    """The C++ caller's split partials: room for ``splits`` splits."""
    B, H = a["query"].shape[:2]
    return {"m": FakeArray((B * H * splits,)), "l": FakeArray((B * H * splits,)),
            "acc": FakeArray((B * H * splits * MLA_LATENT,))}


def io(x) -> str | None:
    """The element type (kgen.ir.axes.IoDtype) an argument holds, as the C++ caller names
    it (a Tensor carries none); None where it is none of them (Python refuses it)."""
    dt = getattr(x, "dtype", None)
    return next((d.value for d in IoDtype if dt == np.dtype(d.fmt.dtype)), None)


def entry(k, a: dict, variant: str | None, extra: dict | None = None):
    """The entry point serving kernel ``k``'s op over ``k``'s arguments ``a``: (Python
    callable, its positional and keyword arguments, the shim's fields, the arrays by
    name). ``extra``: the entry point's own arguments (num_kv_splits, num_reqs, ...)."""
    a = {n: fake(v) for n, v in a.items()}
    x = dict(extra or {})
    if k.op is Op.MERGE_ATTN_STATES:
        names = ("output", "output_lse", "prefix_output", "prefix_lse", "suffix_output",
                 "suffix_lse")
        order = ("output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse",
                 "output_lse")  # vLLM's, in Python
        pos = [a.get(n) for n in order] + [a["prefill_tokens_with_context"]]
        c = {"op": "merge_attn_states", **{n: a.get(n) for n in names},
             "prefill_tokens_with_context": a["prefill_tokens_with_context"],
             "in_dtype": io(a["prefix_output"]), "out_dtype": io(a["output"]),
             "variant": variant}
        return merge.merge_attn_states, pos, {"variant": variant}, c, a
    if k.op is Op.MLA_STORE:
        names = ("kv_c", "k_pe", "kv_cache", "slot_mapping")
        for n, width in (("kv_c", MLA_LATENT), ("k_pe", MLA_ROPE)):
            pad = x.pop(f"{n}_pad", 0)
            if pad:  # rows `pad` elements apart beyond their width
                rows, e = a[n].shape[0], a[n].dtype
                a[n] = FakeArray((rows, width), e, ((width + pad) * e.itemsize, e.itemsize))
        c = {"op": "concat_and_cache_mla", **{n: a[n] for n in names},
             "in_dtype": io(a["kv_c"]), "variant": variant}
        return mla.concat_and_cache_mla, [a[n] for n in names], \
            {"validate": False, "variant": variant}, c, a
    if k.op is Op.MLA_GATHER:
        names = ("dst", "src_cache", "block_table", "cu_seq_lens", "token_to_seq",
                 "seq_starts")
        c = {"op": "gather_mla_cache", **{n: a.get(n) for n in names},
             "num_tokens": a["num_tokens"], "in_dtype": io(a["src_cache"]), "variant": variant}
        return mla.gather_mla_cache, [a.get(n) for n in names] + [a["num_tokens"]], \
            {"validate": False, "variant": variant}, c, a
    if k.op in (Op.MLA_DECODE, Op.MLA_COMBINE):
        # kgen's test case of either stage: the decode over the split stage's arguments
        # (the combine's outputs with them); the kernel named for its own stage.
        q = a.get("query")
        if q is None:
            return None
        B, H = q.shape[:2]
        a["out"] = a.get("out", FakeArray((B, H, MLA_LATENT), x.pop("out_dtype", np.float32)))
        if x.pop("lse", False):
            a["lse"] = FakeArray((B, H))
        splits = x.pop("num_kv_splits", ENTRY_PARAMS["num_kv_splits"].default)
        names = ("out", "lse", "query", "kv_cache", "block_table", "seq_lens")
        kw = {"scale": x.pop("scale", None), "num_kv_splits": splits,
              "max_seq_len": x.pop("max_seq_len", None), "validate": False,
              "variants": (variant, None)}
        room = scratch_for(a, max(splits, 2 * SMS))
        c = {"op": "mla_decode_attention", **{n: a.get(n) for n in names},
             "scale": kw["scale"], "num_kv_splits": splits, "max_seq_len": kw["max_seq_len"],
             "sm_count": SMS, "variant_decode": variant, **room,
             "in_dtype": io(a["kv_cache"]), "out_dtype": io(a["out"])}
        return mla.mla_decode_attention, [a.get(n) for n in names], kw, c, a
    if k.op is Op.MLA_PREFILL:
        names = ("out", "lse", "query", "key", "value", "cu_seqlens_q", "cu_seqlens_k")
        causal = k.mask is Mask.CAUSAL
        pos = [a.get(n) for n in names] + [a["scale"], causal, a["max_seqlen_q"]]
        kw = {"max_seqlen_k": x.pop("max_seqlen_k", None), "validate": False,
              "variant": variant}
        c = {"op": "mla_prefill_attention", **{n: a.get(n) for n in names},
             "scale": a["scale"], "causal": causal, "max_seqlen_q": a["max_seqlen_q"],
             "max_seqlen_k": kw["max_seqlen_k"], "in_dtype": io(a["query"]),
             "out_dtype": io(a["out"]), "variant": variant}
        return mla.mla_prefill_attention, pos, kw, c, a
    assert k.op is Op.DFLASH_ATTENTION
    paged = "ctx_key" in a
    if "out_dtype" in x:  # an output of another element type
        a["out"] = FakeArray(a["out"].shape, x.pop("out_dtype"))
    names = (("out", "query", "block_key", "block_value", "ctx_key", "ctx_value",
              "cu_seqlens", "seq_lens", "block_table") if paged else
             ("out", "query", "key", "value", "cu_seqlens"))
    scale = a.get("scale", x.pop("scale", 0.125))
    w = a["sliding_window"]  # the kernels' W; Python's window_size=(W - 1, 0), none for 0
    if type(w) is not int or w < 0 or w > INT_MAX or (w > 0 and a["block_causal"] != 1):
        return None  # no window_size spells it
    kw = {"scale": scale, "causal": bool(a["block_causal"]),
          "window_size": (w - 1, 0) if w else None, "num_reqs": x.pop("num_reqs", None),
          "validate": False, "variant": variant}
    if paged:
        kw["block_size"] = x.pop("block_size", None)
    c = {"op": "dflash_paged_block_attention" if paged else "dflash_block_attention",
         **{n: a[n] for n in names},
         **{n: v for n, v in kw.items() if n not in ("validate", "window_size")},
         "sliding_window": w,
         "in_dtype": io(a["query"]), "out_dtype": io(a["out"])}
    c["causal"] = a["block_causal"]  # the kernel's own flag (2: a broken one)
    fn = dflash.dflash_paged_block_attention if paged else dflash.dflash_block_attention
    if a["block_causal"] not in (0, 1):
        return None  # not a bool: the C++ entry point takes a bool
    return fn, [a[n] for n in names], kw, c, a


SEEN: dict[str, int] = {}


def compare(cp, lib, k, a: dict, variant, extra=None, label="") -> str | None:
    """One call on both sides; a description of the difference, or None."""
    e = entry(k, a, variant, extra)
    if e is None:
        SEEN["not representable"] = SEEN.get("not representable", 0) + 1
        return None
    fn, pos, kw, fields, arrays = e
    n0 = len(cp.launched)
    try:
        fn(*pos, **kw)
        want = None
    except ContractError as exc:
        want = str(exc)
    got = call(lib, fields)
    if want is not None:
        SEEN["refusals"] = SEEN.get("refusals", 0) + 1
        mine = got.split("\t", 3)[-1] if got.startswith("ERR") else got
        if "must be an array of" in want:  # Python prints the object it was given
            want, mine = want.split(", not ")[0], mine.split(", not ")[0]
        return None if mine == want else f"{label}\n  python: {want}\n  c++:    {got}"
    SEEN["launch sequences"] = SEEN.get("launch sequences", 0) + 1
    if not got.startswith("OK"):
        return f"{label}\n  python: {len(cp.launched) - n0} launches\n  c++:    {got}"
    names = Names(arrays)
    theirs = py_launches(cp, names, n0)
    names.new.clear()
    mine = cpp_launches(got, names)
    if mine != theirs:
        return f"{label}\n  python: {theirs}\n  c++:    {mine}"
    count_launches(mine)
    return None


def count_launches(launches) -> None:
    ops = {k.name: k.op for k, _ in generated()}
    for name, *_ in launches:
        key = f"launches of {ops[name].value}"
        SEEN[key] = SEEN.get(key, 0) + 1


def kernels():
    return [k for k, _ in generated() if k.op in OPS]


def extras(k, case) -> list[dict]:
    """The entry point's own arguments a case runs with (each shape through each form)."""
    if k.op in (Op.MLA_DECODE, Op.MLA_COMBINE):
        bound = max(r[1] for r in case.requests)
        return [{"num_kv_splits": case.n_splits, "lse": k.lse is Lse.WRITE},
                {"num_kv_splits": 0, "max_seq_len": bound, "scale": 0.05},
                {"num_kv_splits": 0, "lse": True}]
    if k.op is Op.MLA_STORE:
        return [{}, {"kv_c_pad": case.row_pad or 3, "k_pe_pad": case.row_pad}]
    if k.op is Op.MLA_PREFILL:
        return [{}, {"max_seqlen_k": 7}]
    if k.op is Op.DFLASH_ATTENTION:
        n = len(case.requests)
        out = [{}, {"num_reqs": n}]
        if "paged" in k.key_source.value:
            out.append({"num_reqs": n, "block_size": case.block_size})
        return out
    return [{}]


def test_engine_ops_launch_as_python(shim, cp):
    SEEN.clear()
    wrong, n = [], 0
    ks = kernels()
    assert {k.op for k in ks} == set(OPS), "a build without some op of the engine"
    for k in ks:
        for case in cases(k):
            for extra in extras(k, case):
                for variant in (None, k.name if k.op is not Op.MLA_COMBINE else None):
                    if k.op is Op.MLA_COMBINE:  # the combine named through the decode
                        d = next(x for x in ks if x.op is Op.MLA_DECODE)
                        a = host_args(d, case)
                        why = compare_combine(cp, shim, d, k, a, extra, f"{k.name} {case.name}")
                    else:
                        a = host_args(k, case)
                        why = compare(cp, shim, k, a, variant, extra,
                                      f"{k.name} {case.name} {extra} variant={variant}")
                    n += 1
                    if why:
                        wrong.append(why)
    assert not wrong, f"{len(wrong)} of {n} calls differ:\n" + "\n".join(wrong[:8])
    print(f"{n} calls compared: {SEEN}")
    assert SEEN.get("launch sequences", 0) > n // 2, SEEN
    for op in OPS:
        assert SEEN.get(f"launches of {op.value}", 0) > 0, (op, SEEN)


def compare_combine(cp, lib, d, k, a, extra, label):
    """The decode with the combine ``k`` named (its lse axis asked for)."""
    extra = {**extra, "lse": k.lse is Lse.WRITE, "out_dtype": np.dtype(k.out_dtype.fmt.dtype)}
    e = entry(d, a, None, extra)
    fn, pos, kw, fields, arrays = e
    kw["variants"] = (None, k.name)
    fields["variant_combine"] = k.name
    n0 = len(cp.launched)
    fn(*pos, **kw)
    got = call(lib, fields)
    if not got.startswith("OK"):
        return f"{label}\n  python: launched\n  c++:    {got}"
    names = Names(arrays)
    theirs = py_launches(cp, names, n0)
    names.new.clear()
    mine = cpp_launches(got, names)
    assert theirs[-1][0] == k.name
    SEEN["launch sequences"] = SEEN.get("launch sequences", 0) + 1
    if mine != theirs:
        return f"{label}\n  python: {theirs}\n  c++:    {mine}"
    count_launches(mine)
    return None


def test_engine_ops_refuse_as_python(shim, cp):
    """Every contract mutation of these kernels a Tensor can carry, through the entry
    point; then the entry points' own refusals."""
    SEEN.clear()
    wrong, n = [], 0
    for k in kernels():
        if k.op is Op.MLA_COMBINE:
            continue  # its arguments are the decode's own partials
        case = cases(k)[0]
        for name in mutations_for(k):
            m = MUTATIONS[name]
            if m.contract in UNSEEN:
                continue
            try:
                a = m.make(k, case)
            except Exception:  # noqa: BLE001 - a mutation of another shape family
                continue
            if any(isinstance(v, list) for v in a.values()):
                continue  # not an array
            why = compare(cp, shim, k, a, k.name, None, f"{k.name} {name}")
            n += 1
            if why:
                wrong.append(why)
        for extra in own_refusals(k, case):
            why = compare(cp, shim, k, host_args(k, case), extra.pop("variant", None), extra,
                          f"{k.name} {extra}")
            n += 1
            if why:
                wrong.append(why)
    assert not wrong, f"{len(wrong)} of {n} calls differ:\n" + "\n".join(wrong[:8])
    print(f"{n} refusal calls compared: {SEEN}")
    assert SEEN.get("refusals", 0) > n // 2, SEEN


def own_refusals(k, case) -> list[dict]:
    """The entry point's own arguments out of range, and kernels it cannot name."""
    other = next(x.name for x in kernels() if x.op is not k.op)
    out = [{"variant": "no_such_kernel"}, {"variant": other}]
    p = ENTRY_PARAMS["num_kv_splits"]
    if k.op is Op.MLA_DECODE:
        out += [{"num_kv_splits": p.lo - 1}, {"num_kv_splits": p.hi + 1},
                {"num_kv_splits": 0, "max_seq_len": 0}, {"max_seq_len": 2**31}]
    if k.op is Op.MLA_PREFILL:
        out += [{"max_seqlen_k": 0}]
    if k.op is Op.DFLASH_ATTENTION:
        n = len(case.requests)
        out += [{"num_reqs": 0}, {"num_reqs": n + 1}]
        if "paged" in k.key_source.value:
            out += [{"block_size": 0}, {"block_size": case.block_size + 1}]
        # an output neither f32 nor of the inputs' element type
        bad = next(d for d in IoDtype if d not in (IoDtype.F32, k.in_dtype))
        out += [{"out_dtype": np.dtype(bad.fmt.dtype)}]
    return out


def test_mla_decode_scratch_and_rank(shim, cp):
    """Scratch the C++ caller lends for the split partials: too small is refused before
    any launch (Python allocates it); a query of the wrong rank is refused as Python
    refuses it (its message up to the object it prints)."""
    d = next(k for k in kernels() if k.op is Op.MLA_DECODE)
    case = cases(d)[0]
    a = host_args(d, case)
    _, _, kw, fields, _ = entry(d, a, None, {"num_kv_splits": case.n_splits})
    got = call(shim, fields)
    assert got.startswith("OK"), got
    B, H = a["query"].shape[:2]
    need = B * H * case.n_splits
    for name, size in (("m", need - 1), ("l", need - 1), ("acc", need * MLA_LATENT - 1)):
        f = dict(fields, **{name: FakeArray((size,))})
        got = call(shim, f)
        assert got.startswith("ERR") and got.split("\t")[2] == "scratch", got
        assert f"{name} must be a C-contiguous float32 buffer of at least" in got, got
    got = call(shim, {k: v for k, v in fields.items() if k != "acc"})
    assert got.split("\t")[2] == "scratch", got
    # the default split count over several bounds and SM counts, as Python's rule
    for bound in (1, 511, 512, 513, 4096, 100000):
        for sms in (1, SMS, 132):
            got = call(shim, {"op": "mla_default_splits", "max_seq_len": bound, "sm_count": sms})
            assert int(got) == mla_default_splits(bound, sms), (bound, sms, got)


# ---- SlotKVCache (kgen::ops::slot_attention) ------------------------------------------

@pytest.fixture
def slots_cp(monkeypatch, tmp_path):
    from kgen.runtime import options, tuned

    monkeypatch.setattr(device, "_SMS", {})
    monkeypatch.setattr(tuned, "_loaded", {})
    monkeypatch.setattr(tuned, "current_device", lambda: ("kgen fake GPU", 13000))
    monkeypatch.setenv("KGEN_TUNE_DIR", str(tmp_path / "tune"))
    monkeypatch.setattr(options, "_NO_SINKS", {})
    plain = FakeArray.__getitem__

    def view(self, key):  # a slot's rings, a slot's rows: views at their offset, as CuPy's
        out = plain(self, key)
        first = key if isinstance(key, int) else key.indices(self.shape[0])[0]
        if first:
            out.data = type(self.data)(self.data.device_id, self.data.ptr + first * self.strides[0])
        return out
    monkeypatch.setattr(FakeArray, "__getitem__", view)
    return FakeCupy().install(monkeypatch)


def slot_kernels():
    return [k for k, _ in generated() if k.op is Op.FLASH and k.position.value == "slots"]


def _slot_options(case, k) -> tuple[dict, dict]:
    """The case's attention options: SlotKVCache.decode's keywords and the shim's fields."""
    py, c = {}, {}
    if k.window.value == "exact" and case.window is not None:
        py["window_size"] = case.window
        c["window_left"], c["window_right"] = py["window_size"]
    if k.softcap.value == "tanh":
        py["softcap"] = c["logits_soft_cap"] = float(case.softcap)
    if case.attn_win and k.window.value != "exact":
        py["attn_win"] = c["attn_win"] = case.attn_win
    if case.attn_sink:
        py["attn_sink"] = c["attn_sink"] = case.attn_sink
    return py, c


def _slot_call(slots_cp, lib, k, case, mode, plan, change=None) -> str | None:
    from kgen.runtime.kv import SlotKVCache

    change = change or {}
    ns = change.get("nslots", len(case.positions))
    hk, hd, kv = case.n_head_kv, case.head_dim, k.kv.value
    sink, win = (case.sink, case.win) if k.fmt.shadows else (0, 0)
    base = {"op": "slot_attention", "kv": kv, "nslots": ns, "n_head_kv": hk, "head_dim": hd,
            "max_seq": case.max_seq, "sink": sink, "win": win, "sm_count": SMS}
    try:
        cache = SlotKVCache(ns, hk, hd, case.max_seq, kv=kv, sink=sink, win=win)
    except ContractError as exc:
        got = call(lib, base)
        SEEN["refusals"] = SEEN.get("refusals", 0) + 1
        return None if got.split("\t", 3)[-1] == str(exc) else f"{k.name}: {exc} / {got}"
    named = {"k": cache.k, "v": cache.v}
    named.update(zip(("k_sink", "v_sink", "k_win", "v_win"), cache.shadows, strict=False))
    n_head = change.get("n_head", case.n_head)
    py, c = _slot_options(case, k) if mode == "decode" else ({}, {})
    if mode == "decode":
        q = FakeArray((ns, n_head, hd))
        kn, vn = FakeArray((ns, hk, hd)), FakeArray((ns, hk, hd))
        positions = list(change.get("positions", case.positions))
        f = {**base, **named, **c, "q": q, "k_new": kn, "v_new": vn,
             "out": FakeArray((ns, n_head, hd)), "positions": ",".join(map(str, positions)),
             "pos_dev": FakeArray((ns,), np.int32)}
        width = -(-case.max_seq // 16) + 1
        f.update(m=FakeArray((ns * n_head * width,)), l=FakeArray((ns * n_head * width,)),
                 acc=FakeArray((ns * n_head * width * hd,)))
        if plan:
            f["kps"], f["splits_cap"] = plan
            py["kps"], py["splits_cap"] = plan
        run = lambda: cache.decode(q, kn, vn, positions, **py)  # noqa: E731
    else:
        u = change.get("slot", ns - 1)
        n = min(7, case.max_seq)
        q = FakeArray((n, n_head, hd))
        kn, vn = FakeArray((n, hk, hd)), FakeArray((n, hk, hd))
        f = {**base, **named, "slot": u, "q": q, "k_new": kn, "v_new": vn,
             "out": FakeArray((n, n_head, hd)), "pos": change.get("pos", 0),
             # a split prefill's partials (up to 16 splits a row; Python: the cache's own)
             "m": FakeArray((n * n_head * 16,)), "l": FakeArray((n * n_head * 16,)),
             "acc": FakeArray((n * n_head * 16 * hd,))}
        run = lambda: cache.prefill(u, q, kn, vn, f["pos"])  # noqa: E731
    n0 = len(slots_cp.launched)
    try:
        run()
        want = None
    except ContractError as exc:
        want = str(exc)
    got = call(lib, f)
    label = f"{k.name} {case.name} {mode} plan={plan} {change}"
    if want is not None:
        SEEN["refusals"] = SEEN.get("refusals", 0) + 1
        same = got.split("\t", 3)[-1] == want
        return None if same else f"{label}\n  python: {want}\n  c++:    {got}"
    if not got.startswith("OK"):
        return f"{label}\n  python: launched\n  c++:    {got}"
    names = Names({**named, "q": q, "k_new": kn, "v_new": vn})
    theirs = py_launches(slots_cp, names, n0)
    names.new.clear()
    mine = cpp_launches(got, names)
    if mine != theirs:
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                     min(len(mine), len(theirs)))
        return (f"{label}: launch {first}\n  python: {theirs[first:first + 1]}\n"
                f"  c++:    {mine[first:first + 1]}")
    if mode == "decode" and not change.get("by_prefill"):  # the positions the C++ steps
        # write first: Python's upload
        written = [int(v) for v in got.split("\n")[1].split("\t")[4].split(":")[2].split(",")]
        uploaded = next(a for a in slots_cp.launched[n0][3] if isinstance(a, FakeArray)
                        and a.dtype == np.int32)
        if written != uploaded.get().tolist():
            return f"{label}: positions {written} vs {uploaded.get().tolist()}"
    SEEN["launch sequences"] = SEEN.get("launch sequences", 0) + 1
    count_launches(mine)
    return None


def test_slot_cache_launches_as_python(shim, slots_cp):
    """Every generated case of every per-slot decode kernel, through SlotKVCache.decode
    (the default and a given plan) and SlotKVCache.prefill of its last slot."""
    SEEN.clear()
    wrong, n = [], 0
    ks = slot_kernels()
    assert ks, "no per-slot decode kernel built"
    for k in ks:
        for case in cases(k):
            for mode, plan in (("decode", None), ("decode", (32, 3)), ("prefill", None)):
                why = _slot_call(slots_cp, shim, k, case, mode, plan)
                n += 1
                if why:
                    wrong.append(why)
    assert not wrong, f"{len(wrong)} of {n} calls differ:\n" + "\n".join(wrong[:8])
    print(f"{n} slot calls compared: {SEEN}")
    assert SEEN.get("launch sequences", 0) > n // 2, SEEN


def test_slot_decode_past_every_decode_bound_launches_as_python(shim, slots_cp):
    """A group count past every per-slot decode's bound: SlotKVCache.decode runs each
    slot's step as a one-row prefill (a given plan refused), and so does the C++ op."""
    SEEN.clear()
    wrong, n = [], 0
    ks = slot_kernels()
    past = 1 + max(k.max_groups for k in ks)
    for kv in sorted({k.kv.value for k in ks}):
        k = next(x for x in ks if x.kv.value == kv)
        case = cases(k)[0]
        for plan in (None, (32, 3)):
            why = _slot_call(slots_cp, shim, k, case, "decode", plan,
                             {"n_head": case.n_head_kv * past, "by_prefill": True})
            n += 1
            if why:
                wrong.append(why)
    assert not wrong, f"{len(wrong)} of {n} calls differ:\n" + "\n".join(wrong[:8])
    assert SEEN.get("launch sequences", 0) == n // 2 and SEEN.get("refusals", 0) == n // 2, SEEN


def test_slot_cache_refuses_as_python(shim, slots_cp):
    SEEN.clear()
    wrong, n = [], 0
    for k in slot_kernels()[::5]:
        case = cases(k)[0]
        ns = len(case.positions)
        for mode, change in (("decode", {"positions": case.positions[:-1]}),
                             ("decode", {"positions": (case.max_seq,) * ns}),
                             ("decode", {"positions": (-1,) * ns}),
                             ("decode", {"n_head": case.n_head_kv * 2 + 1}),
                             ("decode", {"nslots": 0}),
                             ("prefill", {"slot": ns}), ("prefill", {"slot": -1}),
                             ("prefill", {"pos": case.max_seq - 3}),
                             ("prefill", {"n_head": case.n_head_kv * 2 + 1})):
            for plan in ((None, (0, 4)) if mode == "decode" else (None,)):
                why = _slot_call(slots_cp, shim, k, case, mode, plan, change)
                n += 1
                if why:
                    wrong.append(why)
    assert not wrong, f"{len(wrong)} of {n} calls differ:\n" + "\n".join(wrong[:8])
    assert SEEN.get("refusals", 0) >= n * 3 // 4, SEEN
