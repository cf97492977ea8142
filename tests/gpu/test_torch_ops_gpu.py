"""torch.ops.kgen (kgen.torch) on a GPU. Every op runs at the case its op draws from its
own test cases (kgen.testing.calls), with seeded random contents (the seed is in every
failure message) and the arrays it writes poisoned with NaN first:

* called through torch, it gives the direct kgen call's bits in every element of every
  array it writes and of its result, and it writes something;
* called on a torch side stream with no stream argument, it runs on that stream: its
  inputs are written there behind a long sleep, so a launch on any other stream would
  read the poison;
* captured in a CUDA graph, each replay over new inputs gives the direct call's bits;
* torch.library.opcheck passes on real tensors (the schema's mutations are the only
  writes; the fake kernel's result matches the real one; AOT dispatch).

An engine step (reshape_and_cache, paged_attention, attention_dense_fast) compiled with
torch.compile(fullgraph=True) gives the uncompiled step's bits. A bf16 prefill and a
decode step through the pages are checked element by element against float64
attention."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import kgen.runtime as runtime  # noqa: E402
import kgen.torch as kt  # noqa: E402
from kgen import numpy_ref as ref  # noqa: E402
from kgen.formats import FORMATS  # noqa: E402
from kgen.testing import rng  # noqa: E402
from kgen.testing.calls import call_case  # noqa: E402
from kgen.testing.device import assert_close_as  # noqa: E402

NAMES = list(kt.OPS_BY_NAME)
SLEEP = 20_000_000  # cycles a side stream sleeps before it writes the inputs


@pytest.fixture(scope="module")
def cases() -> dict:
    return {name: call_case(kt.OPS_BY_NAME[name]) for name in NAMES}


def _torch_dtype(dt: np.dtype):
    return torch.bfloat16 if dt == np.uint16 else getattr(torch, np.dtype(dt).name)


def _contents(g, a: np.ndarray, written: bool) -> np.ndarray:
    """Contents for a case's array: the index arrays as the op laid them out; NaN for a
    float array the call writes, random bytes for a quantized one; float inputs normal
    (bf16 as float32, rounded on the way in), quantized inputs zero."""
    if a.dtype.kind in "iu" and a.dtype not in (np.uint8, np.uint16):
        return a.copy()  # an index array: its layout is the case
    if a.dtype == np.uint8:  # written: random bytes; read: zeros (finite in any format)
        return g.integers(0, 256, a.shape, dtype=np.uint8) if written else np.zeros_like(a)
    if written:
        return np.full(a.shape, np.nan, np.float32 if a.dtype == np.uint16 else a.dtype)
    return g.standard_normal(a.shape).astype(np.float32 if a.dtype == np.uint16 else a.dtype)


def _host(c, g) -> tuple[dict, object]:
    """The case's arguments with fresh contents, and its PublicCall."""
    call = c.owner.public_calls[[p.name for p in c.owner.public_calls].index(c.call)]
    return {n: _contents(g, v, n in call.writes) if isinstance(v, np.ndarray) else v
            for n, v in c.args.items()}, call


def _cuda(host: dict, case_args: dict, stream=None) -> dict:
    """CUDA tensors of the case's element types holding ``host`` (written on ``stream``
    behind a sleep, where given)."""
    out = {}
    for n, v in host.items():
        if not isinstance(v, np.ndarray):
            out[n] = v
            continue
        dt = _torch_dtype(case_args[n].dtype)
        src = torch.from_numpy(v).to(dt).pin_memory()
        t = torch.empty(v.shape, dtype=dt, device="cuda")
        if stream is None:
            t.copy_(src)
        else:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP)
                t.copy_(src, non_blocking=True)
        out[n] = t
    return out


def _direct(name: str, args: dict):
    """The kgen call itself (no torch dispatch), with the op's arguments."""
    op = kt.OPS_BY_NAME[name]
    return getattr(runtime, name)(**op.call_kwargs(op.bound((), args)))


def _via_torch(name: str, args: dict):
    pos, kw = kt.OPS_BY_NAME[name].split(args)
    return getattr(torch.ops.kgen, name)(*pos, **kw)


def _bits(t) -> np.ndarray:
    return t.contiguous().view(torch.uint8).cpu().numpy().copy()


def _outputs(call, args: dict, result) -> dict:
    out = {n: args[n] for n in call.writes if args.get(n) is not None}
    if call.result:
        out["result"] = result
    return out


def _same(what: str, got: dict, want: dict, seed: int) -> None:
    assert got.keys() == want.keys()
    for n in got:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, n
        a, b = _bits(got[n]), _bits(want[n])
        bad = np.flatnonzero(a != b)
        assert bad.size == 0, (f"{what}: {n} differs from the kgen call's bits in "
                               f"{bad.size} of {a.size} bytes (first at byte {bad[0]}), "
                               f"seed={seed}")


@pytest.mark.parametrize("name", NAMES)
def test_op_gives_the_kgen_calls_bits(cases, name):
    g, seed = rng()
    c = cases[name]
    host, call = _host(c, g)
    mine, theirs = _cuda(host, c.args), _cuda(host, c.args)
    before = {n: _bits(t) for n, t in mine.items() if n in call.writes and t is not None}
    r = _via_torch(name, mine)
    want = _direct(name, theirs)
    torch.cuda.synchronize()
    _same(str(c), _outputs(call, mine, r), _outputs(call, theirs, want), seed)
    for n, b in before.items():
        assert (_bits(mine[n]) != b).any(), f"{c}: {n} not written, seed={seed}"
    if call.result:
        assert isinstance(r, torch.Tensor) and r.is_cuda
        assert (r.shape, r.dtype) == (mine[call.result].shape, mine[call.result].dtype)
        assert not torch.isnan(r).any(), f"{c}: the result holds NaN, seed={seed}"


@pytest.mark.parametrize("name", NAMES)
def test_op_runs_on_the_callers_stream(cases, name):
    g, seed = rng()
    c = cases[name]
    host, call = _host(c, g)
    side = torch.cuda.Stream()
    mine = _cuda(host, c.args, side)  # written on the side stream, behind a sleep
    with torch.cuda.stream(side):
        r = _via_torch(name, mine)
    side.synchronize()
    theirs = _cuda(host, c.args)
    want = _direct(name, theirs)
    torch.cuda.synchronize()
    _same(f"{c} on a side stream", _outputs(call, mine, r), _outputs(call, theirs, want),
          seed)


@pytest.mark.parametrize("name", NAMES)
def test_op_replays_in_a_cuda_graph(cases, name):
    """Captured once (after a warm-up on the capture stream: kernels loaded, scratch
    grown), then replayed over new inputs copied into the captured ones."""
    g, seed = rng()
    c = cases[name]
    host, call = _host(c, g)
    static = _cuda(host, c.args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        warm = _via_torch(name, static)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    del warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        r = _via_torch(name, static)
    for trial in range(2):
        fresh, _ = _host(c, g)
        for n, v in fresh.items():
            if isinstance(v, np.ndarray):
                static[n].copy_(torch.from_numpy(v).to(static[n].dtype))
        graph.replay()
        theirs = _cuda(fresh, c.args)
        want = _direct(name, theirs)
        torch.cuda.synchronize()
        _same(f"{c}, replay {trial}", _outputs(call, static, r),
              _outputs(call, theirs, want), seed)


@pytest.mark.parametrize("name", NAMES)
def test_opcheck_on_cuda_tensors(cases, name):
    g, seed = rng()
    c = cases[name]
    host, _ = _host(c, g)
    pos, kw = kt.OPS_BY_NAME[name].split(_cuda(host, c.args))
    got = torch.library.opcheck(getattr(torch.ops.kgen, name).default, pos, kw)
    assert set(got.values()) == {"SUCCESS"}, f"{c}: {got}, seed={seed}"


# ---- an engine step ----------------------------------------------------------------------

T, H, HK, D, BS = 24, 8, 2, 64, 16


def step(q, k, v, out, key_cache, value_cache, qsl, lens, table, slots):
    torch.ops.kgen.reshape_and_cache(k, v, key_cache, value_cache, slots)
    o = torch.ops.kgen.paged_attention(q, key_cache, value_cache, qsl, lens, table, slots,
                                       T, T)
    torch.ops.kgen.attention_dense_fast(out, q, k, v, causal=True)
    return o, out


def _step_inputs(g) -> dict:
    """One sequence of T tokens over shuffled pages; the output NaN, the pages random
    (attention reads whole tiles of them: rows past the sequence weigh nothing, but a
    NaN there would stay NaN)."""
    blocks = -(-T // BS)
    table = g.permutation(blocks + 1)[:blocks].astype(np.int32)
    slots = np.array([table[p // BS] * BS + p % BS for p in range(T)], np.int32)

    def normal(*shape):
        return torch.from_numpy(g.standard_normal(shape).astype(np.float32)).cuda()
    return dict(q=normal(T, H, D), k=normal(T, HK, D), v=normal(T, HK, D),
                out=torch.full((T, H, D), float("nan"), device="cuda"),
                key_cache=normal(blocks + 1, BS, HK, D),
                value_cache=normal(blocks + 1, BS, HK, D),
                qsl=torch.tensor([0, T], dtype=torch.int32, device="cuda"),
                lens=torch.tensor([T], dtype=torch.int32, device="cuda"),
                table=torch.from_numpy(table[None]).cuda(),
                slots=torch.from_numpy(slots).cuda())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_step_gives_the_uncompiled_bits(backend):
    import torch._dynamo

    g, seed = rng()
    x = _step_inputs(g)
    y = {n: t.clone() for n, t in x.items()}
    torch._dynamo.reset()
    o1, out1 = torch.compile(step, fullgraph=True, backend=backend)(**x)
    o2, out2 = step(**y)
    torch.cuda.synchronize()
    _same(f"compiled ({backend})",
          {"o": o1, "out": out1, "key_cache": x["key_cache"], "value_cache": x["value_cache"]},
          {"o": o2, "out": out2, "key_cache": y["key_cache"], "value_cache": y["value_cache"]},
          seed)
    assert not torch.isnan(o1).any() and not torch.isnan(out1).any(), f"seed={seed}"


def test_bf16_prefill_then_decode_through_the_pages():
    """Two sequences (9 and 20 tokens) prefilled in one varlen step, then a decode step of
    both, all through the torch ops with bf16 q/k/v over float32 pages: the results are
    bf16 (the query's dtype), equal to the direct calls' bits, and every element within
    the bf16 tolerance of float64 attention over the inputs' exact values."""
    g, seed = rng()
    lens, bs, per = (9, 20), 16, 2
    bf16 = FORMATS["bf16"]

    def vals(*shape):
        x = g.standard_normal(shape).astype(np.float32)
        return bf16.dequantize_rows(bf16.quantize_rows(x))

    seqs = [tuple(vals(n + 1, h, D) for h in (H, HK, HK)) for n in lens]
    pages = [torch.from_numpy(g.standard_normal((len(lens) * per, bs, HK, D)).astype(
        np.float32)).cuda() for _ in "kv"]  # random where nothing is stored (see above)
    table = torch.arange(len(lens) * per, dtype=torch.int32, device="cuda").reshape(-1, per)

    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).cuda()

    def meta(rows, past):
        qsl = torch.tensor(np.concatenate([[0], np.cumsum(rows)]), dtype=torch.int32,
                           device="cuda")
        seq_lens = torch.tensor([p + r for p, r in zip(past, rows, strict=True)],
                                dtype=torch.int32, device="cuda")
        slots = torch.tensor([s * per * bs + p for s, (r, p0) in enumerate(
            zip(rows, past, strict=True)) for p in range(p0, p0 + r)], dtype=torch.int32,
            device="cuda")
        return qsl, seq_lens, table, slots

    outs = []
    for rows, past, pick in (((9, 20), (0, 0), lambda x, n: x[:n]),
                             ((1, 1), (9, 20), lambda x, n: x[n:])):
        q, k, v = (t(np.concatenate([pick(s[i], n) for s, n in zip(seqs, lens, strict=True)]))
                   for i in range(3))
        qsl, seq_lens, tab, slots = meta(rows, past)
        theirs = [p.clone() for p in pages]
        torch.ops.kgen.reshape_and_cache(k, v, *pages, slots)
        o = torch.ops.kgen.paged_attention(q, *pages, qsl, seq_lens, tab, slots, max(rows),
                                           max(p + r for p, r in zip(past, rows, strict=True)))
        m = runtime.PagedMetadata(qsl, seq_lens, tab, slots, max(rows), max(
            p + r for p, r in zip(past, rows, strict=True)))
        runtime.reshape_and_cache(k, v, *theirs, m)
        want = runtime.paged_attention(q, *theirs, m)
        torch.cuda.synchronize()
        assert o.dtype == torch.bfloat16 and tuple(o.shape) == (sum(rows), H, D)
        _same("bf16 step", {"o": o, "k": pages[0], "v": pages[1]},
              {"o": want, "k": theirs[0], "v": theirs[1]}, seed)
        outs.append(o.float().cpu().numpy())
    at = 0
    for r, ((q, k, v), n) in enumerate(zip(seqs, lens, strict=True)):
        want = ref.attention_dense(q, k, v, 1 / math.sqrt(D), True)
        assert_close_as(f"prefill seq {r}", bf16, bf16.quantize_rows(outs[0][at:at + n]),
                        want[:n], seed)
        assert_close_as(f"decode seq {r}", bf16, bf16.quantize_rows(outs[1][r:r + 1]),
                        want[n:], seed)
        at += n
