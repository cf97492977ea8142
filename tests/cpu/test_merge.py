"""merge_attn_states (the engine's MergeAttnStates) without a GPU: the float64 reference
against the definition and against attention over the union of the two key sets; the
generated GPU check run over an f32 emulation of the kernel's arithmetic (so its
tolerances and its bit-for-bit checks hold for the arithmetic the kernel does, and a
kernel that breaks the definition fails it); the runtime's entry point with CuPy
replaced by a stand-in (kernel choice, arguments, geometry, refusals before a launch).

Random inputs are fresh each run (KGEN_TEST_SEED=<seed> replays one)."""

from __future__ import annotations

import math

import kgen_kernels
import numpy as np
import pytest

from kgen.ir.axes import IoDtype, Lse, Op
from kgen.ir.geometry import MERGE_ROWS, merge_threads
from kgen.ir.params import PARAMS
from kgen.numpy_ref import merge_attn_states as ref_merge
from kgen.runtime import ContractError, bind, merge_attn_states
from kgen.runtime import merge as runtime_merge
from kgen.testing import merge as tmerge
from kgen.testing.case import Case
from kgen.testing.fakecupy import FakeCupy
from kgen.testing.testgen import plan_cases

INF = math.inf
ALL = {(k.lse, k.in_dtype, k.out_dtype): k for mod in kgen_kernels.MODULES.values()
       for k in mod.KERNELS.values() if k.op is Op.MERGE_ATTN_STATES}
KERNELS = {lse: k for (lse, fi, fo), k in ALL.items() if fi is fo is IoDtype.F32}
HALF = (IoDtype.BF16, IoDtype.F16)


# ---- the reference ---------------------------------------------------------------------

def _scalar_merge(p, p_lse, s, s_lse):
    """One row of the definition, in Python floats."""
    p_lse = -INF if p_lse == INF else p_lse
    s_lse = -INF if s_lse == INF else s_lse
    m = max(p_lse, s_lse)
    if m == -INF:
        return list(p), -INF
    ps, ss = math.exp(p_lse - m), math.exp(s_lse - m)
    return [a * ps / (ps + ss) + b * ss / (ps + ss) for a, b in zip(p, s, strict=True)], \
        m + math.log(ps + ss)


def test_reference_by_hand():
    p = np.array([[[1.0, 2.0]]])  # T = 1, H = 1, Dv = 2
    s = np.array([[[5.0, -2.0]]])
    out, lse = ref_merge(p, np.log([[1.0]]), s, np.log([[3.0]]))
    np.testing.assert_allclose(out, [[[0.25 * 1 + 0.75 * 5, 0.25 * 2 - 0.75 * 2]]])
    np.testing.assert_allclose(lse, np.log([[4.0]]))


def test_reference_row_by_row_on_every_edge(rng):
    g, seed = rng
    case = Case("edges", n=9, n_head=len(tmerge.EDGES), head_dim=3, lse_pattern="edges")
    p, p_lse, s, s_lse = tmerge.inputs(g, case, KERNELS[Lse.NONE])
    out, lse = ref_merge(p, p_lse, s, s_lse)
    assert out.shape == p.shape and lse.shape == p_lse.shape
    assert not np.isnan(out).any() and not np.isnan(lse).any(), seed
    for t in range(case.n):
        for h in range(case.n_head):
            want, want_lse = _scalar_merge(p[t, h].tolist(), float(p_lse[h, t]), s[t, h].tolist(),
                                           float(s_lse[h, t]))
            np.testing.assert_allclose(out[t, h], want, rtol=1e-12, err_msg=f"seed={seed}")
            assert lse[h, t] == pytest.approx(want_lse, rel=1e-12), seed


def test_reference_edges():
    p, s = np.full((1, 6, 2), 3.0), np.full((1, 6, 2), 7.0)
    p_lse = np.array([[-INF], [INF], [INF], [-INF], [1.0], [-INF]])
    s_lse = np.array([[-INF], [INF], [2.0], [2.0], [INF], [INF]])
    out, lse = ref_merge(p, p_lse, s, s_lse)
    # both empty (either infinity): the prefix and -inf; one side empty: the other side.
    assert out[0, :, 0].tolist() == [3.0, 3.0, 7.0, 7.0, 3.0, 3.0]
    assert lse[:, 0].tolist() == [-INF, -INF, 2.0, 2.0, 1.0, -INF]


def test_reference_takes_the_suffix_from_prefill_tokens_with_context(rng):
    g, seed = rng
    T, H, D = 6, 3, 4
    p, s = g.standard_normal((T, H, D)), g.standard_normal((T, H, D))
    p_lse, s_lse = g.standard_normal((H, T)), g.standard_normal((H, T))
    s_lse[0, 5] = INF  # verbatim: not counted as -inf
    merged, merged_lse = ref_merge(p, p_lse, s, s_lse)
    for ctx, tail in ((-1, T), (-7, T), (0, 0), (2, 2), (T, T), (100, T)):
        out, lse = ref_merge(p, p_lse, s, s_lse, ctx)
        assert np.array_equal(out[:tail], merged[:tail]), (ctx, seed)
        assert np.array_equal(lse[:, :tail], merged_lse[:, :tail]), (ctx, seed)
        assert np.array_equal(out[tail:], s[tail:]), (ctx, seed)
        assert np.array_equal(lse[:, tail:], s_lse[:, tail:]), (ctx, seed)


def _attention(q, k, v):
    """Softmax attention of every (token, head) over keys ``k`` [N][H][D], and its LSE
    [H][T], float64."""
    scores = np.einsum("thd,nhd->thn", q, k) / math.sqrt(q.shape[-1])
    m = scores.max(axis=-1, keepdims=True)
    w = np.exp(scores - m)
    lse = (m[..., 0] + np.log(w.sum(axis=-1))).T
    return np.einsum("thn,nhd->thd", w / w.sum(axis=-1, keepdims=True), v), lse


def test_reference_merges_attention_over_disjoint_keys(rng):
    """Attention over a prefix of the keys and over the rest, merged, is attention over
    them all (what the engine merges: a cached prefix and the new suffix)."""
    g, seed = rng
    T, H, D, N = 5, 4, 16, 40
    q, k, v = (g.standard_normal(s) for s in ((T, H, D), (N, H, D), (N, H, D)))
    whole, whole_lse = _attention(q, k, v)
    for cut in (1, 17, 39):
        p, p_lse = _attention(q, k[:cut], v[:cut])
        s, s_lse = _attention(q, k[cut:], v[cut:])
        out, lse = ref_merge(p, p_lse, s, s_lse)
        np.testing.assert_allclose(out, whole, rtol=1e-10, atol=1e-12, err_msg=f"seed={seed}")
        np.testing.assert_allclose(lse, whole_lse, rtol=1e-12, err_msg=f"seed={seed}")


# ---- the GPU check, over an f32 emulation of the kernel -----------------------------------

class HostArray(np.ndarray):
    """A NumPy array with CuPy's ``get``, standing in for a device array."""

    def get(self):
        return np.asarray(self).copy()


def _emulated(k, fault: str | None = None):
    """A launcher doing what templates/kernels/merge_attn_states.cu.j2 does, in f32
    NumPy (the kernel's fmaf contraction aside; elements widened from in_dtype, results
    rounded to out_dtype by the formats' NumPy models); ``fault`` breaks one rule on
    purpose."""
    fi, fo = k.in_dtype.fmt, k.out_dtype.fmt

    def fn(*arrays, prefill_tokens_with_context=-1, stream=None):
        if k.lse is Lse.WRITE:
            out, out_lse, p, p_lse, s, s_lse = arrays
        else:
            (out, p, p_lse, s, s_lse), out_lse = arrays, None
        p, s = fi.dequantize_rows(np.asarray(p)), fi.dequantize_rows(np.asarray(s))
        T = out.shape[0]
        pl, sl = np.asarray(p_lse).T, np.asarray(s_lse).T  # [T][H]
        if fault == "lse_transposed":
            pl, sl = (np.asarray(x).reshape(T, -1) for x in (p_lse, s_lse))
        if fault != "plus_inf_kept":
            pl = np.where(np.isinf(pl), np.float32(-INF), pl)
            sl = np.where(np.isinf(sl), np.float32(-INF), sl)
        m = np.fmax(pl, sl)
        empty = np.isinf(m) if fault != "no_empty_rule" else np.zeros_like(m, bool)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            ps, ss = np.exp(pl - m), np.exp(sl - m)
            total = ps + ss
            p_scale, s_scale = ps / total, ss / total
            merged = p * p_scale[..., None] + s * s_scale[..., None]
            lse = np.log(total) + m
        assert merged.dtype == np.float32 and lse.dtype == np.float32
        ctx = prefill_tokens_with_context if fault != "ctx_ignored" else -1
        tail = np.zeros(m.shape, bool)
        if ctx >= 0:
            tail[ctx:] = True
        out[...] = fo.quantize_rows(np.where(tail[..., None], s,
                                             np.where(empty[..., None], p, merged)))
        if out_lse is not None:
            out_lse[...] = np.where(tail, np.asarray(s_lse).T, np.where(empty, m, lse)).T
    return fn


@pytest.fixture
def host_device(monkeypatch):
    """kgen.testing.merge's device arrays as NumPy arrays."""
    monkeypatch.setattr(tmerge, "dev", lambda x: np.array(x).view(HostArray))
    monkeypatch.setattr(tmerge, "poisoned", lambda shape: np.full(shape, np.nan, np.float32)
                        .view(HostArray))
    monkeypatch.setattr(tmerge, "poisoned_as", lambda shape, fmt: np.full(
        shape, fmt.poison(), np.dtype(fmt.dtype)).view(HostArray))


def _cases():
    return [pytest.param(key, c, id=f"{k.name}-{c}")
            for key, k in sorted(ALL.items()) for c in plan_cases(k)[0]]


def test_every_kernel_is_built():
    assert set(KERNELS) == {Lse.NONE, Lse.WRITE}
    assert set(ALL) == {(lse, d, d) for lse in Lse for d in (IoDtype.F32, *HALF)}


@pytest.mark.parametrize("key, case", _cases())
def test_the_gpu_check_passes_the_kernels_arithmetic(host_device, key, case):
    tmerge.check(ALL[key], _emulated(ALL[key]), case)


@pytest.mark.parametrize("dtype", [IoDtype.F32, *HALF])
@pytest.mark.parametrize("fault", ["lse_transposed", "plus_inf_kept", "no_empty_rule",
                                   "ctx_ignored"])
def test_the_gpu_check_fails_a_kernel_that_breaks_the_definition(host_device, fault, dtype):
    k = ALL[(Lse.WRITE, dtype, dtype)]
    case = Case("faulty", n=7, n_head=len(tmerge.EDGES), head_dim=40, lse_pattern="edges",
                prefill_tokens_with_context=4)
    with pytest.raises(AssertionError):
        tmerge.check(k, _emulated(k, fault), case)


def test_the_gpu_cases_cover_the_engines_shapes():
    cases = plan_cases(KERNELS[Lse.WRITE])[0]
    assert {1, 128} <= {c.n_head for c in cases}
    assert {128, 512} <= {c.head_dim for c in cases}
    assert 1 in {c.n for c in cases}
    assert any(c.n * c.n_head % MERGE_ROWS for c in cases)  # a partial last block
    ctx = {(c.prefill_tokens_with_context, c.n) for c in cases}
    assert {-1} <= {x for x, _ in ctx}
    for want in (lambda t: 0, lambda t: t // 2, lambda t: t):
        assert any(x == want(t) and t > 1 for x, t in ctx)
    assert {"random", "wide", "edges"} == {c.lse_pattern for c in cases}


def test_bind_geometry_default_and_range():
    k = KERNELS[Lse.WRITE]
    for T, H, D in ((1, 1, 1), (37, 3, 512), (2, 128, 128)):
        a = tmerge.host_args(k, Case("c", n=T, n_head=H, head_dim=D))
        a.pop("prefill_tokens_with_context")
        b = bind(k, a)
        assert b.grid == (-(-T * H // MERGE_ROWS), 1, 1) and b.grid[0] * MERGE_ROWS >= T * H
        assert b.block == (merge_threads(), 1, 1) and b.shared_bytes == 0
        assert b.arg("prefill_tokens_with_context") == np.int32(-1)  # the table's default
    p = PARAMS["prefill_tokens_with_context"]
    assert (p.default, p.neutral) == (-1, -1)
    for ok in (p.lo, -1, 0, p.hi):
        assert bind(k, {**a, p.name: ok}).arg(p.name) == np.int32(ok)
    for bad in (p.lo - 1, p.hi + 1):
        with pytest.raises(ContractError) as e:
            bind(k, {**a, p.name: bad})
        assert e.value.contract == "range"


# ---- the runtime's entry point, with CuPy a stand-in ------------------------------------

@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setattr(runtime_merge, "_CHOSEN", {})
    return FakeCupy().install(monkeypatch)


def _arrays(cp, T=37, H=3, D=128):
    return ([cp.empty((T, H, D)), cp.empty((H, T))] +
            [cp.empty(s) for s in ((T, H, D), (H, T), (T, H, D), (H, T))])


@pytest.mark.parametrize("with_lse", [False, True])
def test_entry_point_launches_the_kernel_the_call_needs(cp, with_lse):
    out, out_lse, p, p_lse, s, s_lse = _arrays(cp)
    b = merge_attn_states(out, p, p_lse, s, s_lse, out_lse if with_lse else None, 18)
    (name, grid, block, args, shared, _), = cp.launched
    k = KERNELS[Lse.WRITE if with_lse else Lse.NONE]
    assert name == b.kernel == k.name
    assert grid == (-(-37 * 3 // MERGE_ROWS), 1, 1) and block == (merge_threads(), 1, 1)
    assert shared == 0
    assert b.arg("output") is out and b.arg("prefix_lse") is p_lse and b.arg("suffix_lse") is s_lse
    assert b.arg("prefix_output") is p and b.arg("suffix_output") is s
    assert ("output_lse" in b.names) is with_lse
    assert not with_lse or b.arg("output_lse") is out_lse
    assert [int(b.arg(n)) for n in ("n_tokens", "n_head", "head_dim",
                                    "prefill_tokens_with_context")] == [37, 3, 128, 18]
    merge_attn_states(out, p, p_lse, s, s_lse, out_lse if with_lse else None)
    assert int(cp.launched[-1][3][b.names.index("prefill_tokens_with_context")]) == -1


def test_entry_point_refuses_before_launching(cp):
    out, out_lse, p, p_lse, s, s_lse = _arrays(cp)
    bad = [
        ("lse layout", (out, p, cp.empty((37, 3)), s, s_lse, out_lse)),  # [T][H]
        ("lse layout", (out, p, p_lse, s, s_lse, cp.empty((3, 36)))),
        ("shape", (out, p, p_lse, cp.empty((37, 3, 64)), s_lse, out_lse)),
        ("dtype", (out, p, p_lse, s, cp.empty((3, 37), np.float16))),
        ("contiguous", (out, cp.ndarray((37, 3, 128), np.float32, (3072, 1024, 8)),
                        p_lse, s, s_lse)),
        ("device", (out, np.zeros((37, 3, 128), np.float32), p_lse, s, s_lse)),
    ]
    for contract, args in bad:
        with pytest.raises(ContractError) as e:
            merge_attn_states(*args)
        assert e.value.contract == contract, (contract, e.value)
    with pytest.raises(ContractError) as e:
        merge_attn_states(out, p, p_lse, s, s_lse, out_lse, prefill_tokens_with_context=1.5)
    assert e.value.contract == "type"
    assert cp.launched == []


def test_entry_point_variant_must_serve_the_call(cp):
    out, out_lse, p, p_lse, s, s_lse = _arrays(cp)
    with pytest.raises(ContractError, match="cannot serve") as e:
        merge_attn_states(out, p, p_lse, s, s_lse, out_lse, variant=KERNELS[Lse.NONE].name)
    assert e.value.contract == "variant"
    b = merge_attn_states(out, p, p_lse, s, s_lse, None, variant=KERNELS[Lse.NONE].name)
    assert b.kernel == KERNELS[Lse.NONE].name


@pytest.mark.parametrize("dtype", HALF)
def test_entry_point_chooses_by_element_type(cp, dtype):
    """16-bit outputs (bf16 as uint16 bits, f16 as float16) take their kernel; the LSEs
    stay float32; a merged output of another type than the two merged is refused before
    any launch (no kernel serves it)."""
    e = np.dtype(dtype.fmt.dtype)
    out, out_lse, p, p_lse, s, s_lse = _arrays(cp)
    out, p, s = (cp.empty(x.shape, e) for x in (out, p, s))
    for with_lse in (False, True):
        b = merge_attn_states(out, p, p_lse, s, s_lse, out_lse if with_lse else None)
        assert b.kernel == ALL[(Lse.WRITE if with_lse else Lse.NONE, dtype, dtype)].name
    n = len(cp.launched)
    with pytest.raises(ContractError) as err:
        merge_attn_states(cp.empty(out.shape, np.float32), p, p_lse, s, s_lse)
    assert err.value.contract == "no kernel"
    with pytest.raises(ContractError) as err:
        merge_attn_states(out, p, p_lse, cp.empty(s.shape, np.float32), s_lse)
    assert err.value.contract == "dtype"
    with pytest.raises(ContractError) as err:
        merge_attn_states(out, cp.empty(p.shape, np.float64), p_lse, s, s_lse)
    assert err.value.contract == "dtype"
    assert len(cp.launched) == n
