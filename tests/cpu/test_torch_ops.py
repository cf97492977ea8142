"""torch.ops.kgen (kgen.torch) without a GPU: one op for each public call that the
registry's ops describe, with a schema that follows the call's signature (the arrays it
writes are mutated arguments). Each op runs at a case its op draws from its own test
cases (kgen.testing.calls):

* under FakeTensor, where its fake kernel gives the result's shape and dtype;
* through torch.library.opcheck on meta tensors;
* through its real kernel, which is the kgen call, with CuPy replaced by a stand-in:
  every contract is checked and every launch recorded, and the result has the fake
  kernel's shape and dtype;
* with CPU tensors, which kgen refuses (ContractError) before anything is written.

torch.compile(fullgraph=True) traces a step of two ops on meta tensors with no graph
break. The whole module skips where torch is not installed."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kgen.runtime as runtime  # noqa: E402
import kgen.torch as kt  # noqa: E402
from kgen import ops  # noqa: E402
from kgen.runtime import ContractError, engine, tuned  # noqa: E402
from kgen.testing.built import needs_build  # noqa: E402
from kgen.testing.calls import call_case  # noqa: E402
from kgen.testing.fakecupy import FakeArray, FakeCupy, Guarded  # noqa: E402

CALLS = [c for d in ops.OPS.values() for c in d.public_calls]
NAMES = [c.name for c in CALLS]
BY_NAME = {c.name: c for c in CALLS}


def _torch_dtype(dt: np.dtype):
    """The torch dtype of a kgen array's element type (uint16: bf16 bit patterns)."""
    return torch.bfloat16 if dt == np.uint16 else getattr(torch, np.dtype(dt).name)


def _split(name: str, args: dict) -> tuple[tuple, dict]:
    return kt.OPS_BY_NAME[name].split(args)


def _tensors(args: dict, make) -> dict:
    """Each host array of ``args`` as ``make(array)``; scalars and None as they are."""
    return {n: make(v) if isinstance(v, np.ndarray) else v for n, v in args.items()}


# ---- the registry and the schemas ---------------------------------------------------------

def test_every_public_call_of_the_registry_is_one_torch_op():
    entries = {e for d in ops.OPS.values() for e in d.entries}
    assert len(NAMES) == len(set(NAMES)), "a call described by two ops"
    assert set(NAMES) == entries, "every entry is described once, by an op that launches it"
    assert list(kt.OPS_BY_NAME) == NAMES
    for name in NAMES:
        assert getattr(torch.ops.kgen, name).default is kt.OPS_BY_NAME[name].op


def _expected(name: str) -> list[tuple[str, bool, object]]:
    """(name, keyword-only, default) of each argument the op should have: the call's
    parameters less stream= and those it leaves, a PagedMetadata's in its place."""
    call = BY_NAME[name]
    out = []
    for p in inspect.signature(getattr(runtime, name)).parameters.values():
        if p.name == "stream" or p.name in call.leaves:
            continue
        if p.annotation == "PagedMetadata":
            for q in inspect.signature(runtime.PagedMetadata).parameters.values():
                if q.name != "stream":
                    out.append((q.name, q.kind is q.KEYWORD_ONLY, q.default))
            continue
        out.append((p.name, p.kind is p.KEYWORD_ONLY, p.default))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_schema_follows_the_calls_signature(name):
    """The op's arguments are the call's (names, order, keyword-only, defaults; a default
    the schema cannot spell is None there); the mutated ones are those the call writes;
    it returns a tensor only where the call returns a new array."""
    schema = getattr(torch.ops.kgen, name).default._schema
    call = BY_NAME[name]
    got = [(a.name, a.kwarg_only, a.default_value if a.has_default_value() else
            inspect.Parameter.empty) for a in schema.arguments]
    want = [(n, kw, None if isinstance(d, tuple) else d) for n, kw, d in _expected(name)]
    assert got == want
    written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    assert written == set(call.writes)
    for a in schema.arguments:
        is_tensor = "Tensor" in str(a.type)
        assert is_tensor == (a.name in {*written, *call.optional, *call.tensors} or
                             a.name in runtime_arrays(name)), a.name
    assert [str(r.type) for r in schema.returns] == (["Tensor"] if call.result else [])


def runtime_arrays(name: str) -> set[str]:
    """The arrays the call's convention converts (a PagedMetadata's too)."""
    out = set(getattr(runtime, name).__kgen_public__[1])
    return out | set(runtime.PagedMetadata.__init__.__kgen_public__[1])


def test_a_parameter_with_no_torch_type_is_refused():
    """A public call whose parameter has no schema type is named at registration."""
    from kgen.ops import PublicCall

    def fake(x, mode: dict, stream=None):
        return None

    fake.__kgen_public__ = ("fake", frozenset({"x"}), False)
    runtime.__dict__["_torch_op_probe"] = fake
    try:
        with pytest.raises(TypeError, match="mode"):
            kt.TorchOp(PublicCall("_torch_op_probe"))
        with pytest.raises(TypeError, match="lacks"):
            kt.TorchOp(PublicCall("_torch_op_probe", writes=("y",), leaves=("mode",)))
        op = kt.TorchOp(PublicCall("_torch_op_probe", writes=("x",), leaves=("mode",)))
        assert op.schema == "(Tensor(a!) x) -> ()"
    finally:
        del runtime.__dict__["_torch_op_probe"]


# ---- each op at its registry case ---------------------------------------------------------

@pytest.fixture(scope="module")
def cases() -> dict:
    return {name: call_case(kt.OPS_BY_NAME[name]) for name in NAMES}


@needs_build
@pytest.mark.parametrize("name", NAMES)
def test_fake_kernel_gives_the_results_shape_and_dtype(cases, name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    c, call = cases[name], BY_NAME[name]
    with FakeTensorMode():
        args = _tensors(c.args, lambda a: torch.empty(
            a.shape, dtype=_torch_dtype(a.dtype), device="cuda"))
        before = {n: (args[n].shape, args[n].dtype) for n in call.writes if
                  args.get(n) is not None}
        pos, kw = _split(name, args)
        r = getattr(torch.ops.kgen, name)(*pos, **kw)
    assert bool(before) == bool(call.writes), f"{c}: a written array not given"
    for n, (shape, dtype) in before.items():
        assert (args[n].shape, args[n].dtype) == (shape, dtype)
    if call.result is None:
        assert r is None
    else:
        like = args[call.result]
        assert (r.shape, r.dtype, r.device.type) == (like.shape, like.dtype, "cuda"), str(c)
        assert r.is_contiguous()


@needs_build
@pytest.mark.parametrize("name", NAMES)
def test_opcheck_on_meta_tensors(cases, name):
    c = cases[name]
    args = _tensors(c.args, lambda a: torch.empty(a.shape, dtype=_torch_dtype(a.dtype),
                                                  device="meta"))
    pos, kw = _split(name, args)
    got = torch.library.opcheck(getattr(torch.ops.kgen, name).default, pos, kw)
    assert got and set(got.values()) == {"SUCCESS"}, got


@pytest.fixture
def cp(monkeypatch):
    """CuPy replaced by the stand-in; the engine's kept kernels and scratch its own."""
    monkeypatch.setattr(tuned, "tuned", lambda *a: None)
    monkeypatch.setattr(tuned, "tuned_prefill", lambda *a: None)
    monkeypatch.setattr(engine, "_KERNELS", {})
    monkeypatch.setattr(engine, "_SCRATCH", {})
    return FakeCupy().install(monkeypatch)


def _written(launched) -> set[int]:
    """The memory (FakeArray data objects) that the recorded launches' kernels write: the
    arrays they take as non-const pointers (kgen.ops.params)."""
    import kgen_kernels

    kernels = {k.name: k for mod in kgen_kernels.MODULES.values() for k in mod.KERNELS.values()}
    out = set()
    for name, _grid, _block, args, _shared, _stream in launched:
        for p, v in zip(ops.params(kernels[name]), args, strict=True):
            if p.is_pointer and not p.ctype.startswith("const") and isinstance(v, FakeArray):
                out.add(id(v.data))
    return out


@needs_build
@pytest.mark.parametrize("name", NAMES)
def test_real_kernel_is_the_kgen_call(cases, cp, name):
    """The function torch runs for the op is the kgen call with the op's arguments (a
    PagedMetadata built from its own): at the registry case every contract holds, the
    kernels launch (recorded), the arguments their kernels write are exactly those the
    op declares mutated, and a result has the shape and dtype the fake kernel gives."""
    c, call = cases[name], BY_NAME[name]
    args = _tensors(c.args, lambda a: FakeArray(a.shape, a.dtype, host=a.copy()))
    r = kt.OPS_BY_NAME[name].real(**args)
    assert cp.launched, f"{c}: nothing launched"
    written = _written(cp.launched)
    assert {n for n, v in args.items() if isinstance(v, FakeArray) and id(v.data) in written
            } == {n for n in call.writes if args.get(n) is not None}, str(c)
    if call.result is None:
        assert r is None
    else:
        like = args[call.result]
        assert (tuple(r.shape), r.dtype) == (tuple(like.shape), like.dtype), str(c)
        assert id(r.data) in written, f"{c}: the result is not what the kernels wrote"


@needs_build
@pytest.mark.parametrize("name", NAMES)
def test_real_kernel_captures(monkeypatch, cases, name):
    """What a CUDA graph needs of the op while its stream captures, after a warm-up: the
    kgen call reads nothing back (validate=None), uploads, fills and sets nothing, and
    launches what it launched outside the capture."""
    monkeypatch.setattr(tuned, "tuned", lambda *a: None)
    monkeypatch.setattr(tuned, "tuned_prefill", lambda *a: None)
    monkeypatch.setattr(engine, "_KERNELS", {})
    monkeypatch.setattr(engine, "_SCRATCH", {})
    cp = Guarded().install(monkeypatch)
    get = FakeArray.get

    def read(a, stream=None):
        cp._touch(("read back", a.shape))
        return get(a, stream)

    monkeypatch.setattr(FakeArray, "get", read)
    c = cases[name]
    args = _tensors(c.args, lambda a: FakeArray(a.shape, a.dtype, host=a.copy()))
    kt.OPS_BY_NAME[name].real(**args)  # the warm-up
    warm = [(n, g, b) for n, g, b, *_ in cp.launched]
    cp.launched.clear()
    cp.capturing, cp.armed, cp.touched = 1, True, []
    kt.OPS_BY_NAME[name].real(**args)
    cp.armed = False
    assert [(n, g, b) for n, g, b, *_ in cp.launched] == warm, str(c)
    assert [t for t in cp.touched if t[0] not in ("alloc", "launch")] == [], str(c)


@needs_build
@pytest.mark.parametrize("name", NAMES)
def test_host_tensors_are_refused_before_anything_is_written(cases, name):
    """CPU tensors reach kgen through the op's real kernel, which refuses them
    (ContractError, contract ``device``) with every written tensor as it was."""
    c, call = cases[name], BY_NAME[name]
    args = _tensors(c.args, lambda a: torch.from_numpy(a.copy()).view(_torch_dtype(a.dtype))
                    if a.dtype == np.uint16 else torch.from_numpy(a.copy()))
    for n in call.writes:
        if args.get(n) is not None and args[n].is_floating_point():
            args[n].fill_(float("nan"))
    kept = {n: args[n].clone() for n in call.writes if args.get(n) is not None}
    pos, kw = _split(name, args)
    with pytest.raises(ContractError) as e:
        getattr(torch.ops.kgen, name)(*pos, **kw)
    assert e.value.contract == "device", str(e.value)
    for n, t in kept.items():
        assert torch.equal(args[n].view(torch.uint8), t.view(torch.uint8)), n


# ---- torch.compile ------------------------------------------------------------------------

def _engine_step(dev: str):
    """A prefill step of one sequence of 8 tokens over 2 pages, and a dense attention of
    the same rows: the arrays of kgen.reshape_and_cache, kgen.paged_attention and
    kgen.attention_dense_fast."""
    T, H, Hk, D, bs = 8, 4, 2, 64, 16

    def t(*shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device=dev)
    return dict(q=t(T, H, D), k=t(T, Hk, D), v=t(T, Hk, D), out=t(T, H, D),
                key_cache=t(2, bs, Hk, D), value_cache=t(2, bs, Hk, D),
                qsl=t(2, dtype=torch.int32), lens=t(1, dtype=torch.int32),
                table=t(1, 2, dtype=torch.int32), slots=t(T, dtype=torch.int32))


def step(q, k, v, out, key_cache, value_cache, qsl, lens, table, slots):
    torch.ops.kgen.reshape_and_cache(k, v, key_cache, value_cache, slots)
    o = torch.ops.kgen.paged_attention(q, key_cache, value_cache, qsl, lens, table, slots,
                                       q.shape[0], q.shape[0], window_size=[-1, 0])
    torch.ops.kgen.attention_dense_fast(out, q, k, v, causal=True)
    return o + out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_traces_the_ops_in_one_graph(backend):
    """torch.compile(fullgraph=True) captures the step whole (a graph break would raise)
    with the three ops in it, and runs it on meta tensors through the fake kernels."""
    import torch._dynamo

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        if backend == "eager":
            return gm.forward
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=keep)
    x = _engine_step("meta")
    r = compiled(**x)
    assert (r.shape, r.dtype, r.device.type) == (x["q"].shape, torch.float32, "meta")
    assert len(graphs) == 1
    called = [str(n.target).removesuffix(".default") for n in graphs[0].graph.nodes
              if n.op == "call_function"]
    assert [c for c in called if c.startswith("kgen.")] == [
        "kgen.reshape_and_cache", "kgen.paged_attention", "kgen.attention_dense_fast"], called


def test_compile_functionalizes_the_writes():
    """AOT autograd's forward graph of the step: each writing op runs functionalized
    (auto_functionalized) and paged_attention reads the pages that reshape_and_cache's
    functionalized call returns, so the order of the writes and reads is data flow."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def forward(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend=aot_autograd(fw_compiler=forward))(
        **_engine_step("meta"))
    (gm,) = graphs
    nodes = {n.name: n for n in gm.graph.nodes}
    wrapped = [n for n in gm.graph.nodes if n.op == "call_function" and
               "auto_functionalized" in str(n.target)]
    assert [str(n.args[0]) for n in wrapped] == ["kgen.reshape_and_cache.default",
                                                 "kgen.attention_dense_fast.default"]
    (paged,) = [n for n in nodes.values() if str(n.target) == "kgen.paged_attention.default"]
    for cache in paged.args[1:3]:  # key_cache, value_cache
        assert cache.op == "call_function" and cache.args[0] is wrapped[0], gm.code


def test_fake_cuda_tensors_trace_without_a_gpu():
    """The same step traced from FakeTensor CUDA inputs (no GPU here): make_fx records
    each op through its fake kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        x = _engine_step("cuda")
        gm = make_fx(step)(*x.values())
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert called == ["kgen.reshape_and_cache.default", "kgen.paged_attention.default",
                      "kgen.attention_dense_fast.default", "aten.add.Tensor"], called
