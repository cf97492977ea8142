"""kgen's public calls as PyTorch custom ops: ``torch.ops.kgen.<call>``.

    import kgen.torch                      # registers them (kgen itself never imports torch)
    torch.ops.kgen.attention_dense_fast(out, q, k, v, causal=True)

There is one op for each public call that an op of the registry names
(``OpDef.public_calls``), made by one loop from the call's own signature and what the op
says the call does with its arrays (kgen.ops.base.PublicCall):

* Every array parameter is a Tensor. Those the call writes in place are mutated
  arguments (``Tensor(a!)``), so torch.compile functionalizes them, and a CUDA graph
  keeps them in order with the ops around them.
* A scalar keeps its name, default and type (``float | None`` is ``float?``,
  ``window_size=(left, right)`` is ``int[]?``). A torch None where the call's default is
  no None (``variants``) means that default.
* A PagedMetadata parameter takes its constructor's arguments in its place, and the op
  builds the metadata from them on each call.
* ``stream=`` is left out: the op runs on torch's current stream, as the call does when
  it is given torch tensors (kgen.runtime.convention).
* An op returns nothing, unless the call returns a new array (``PublicCall.result``):
  ``paged_attention`` returns its output in the query's dtype.

Each op's fake kernel gives its result's shape and dtype and runs nothing, so FakeTensor,
meta tensors and ``torch.compile(fullgraph=True)`` trace through the ops. The real kernel
is the kgen call itself. It checks every contract before any launch and raises
kgen.ContractError on CPU tensors or any other broken contract. The calls' ``validate``
(None by default) skips read-backs while a CUDA graph is captured.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

try:
    import torch
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("kgen.torch needs PyTorch: pip install 'kgen[torch]' (or any torch "
                      "build for your GPU)") from e

import kgen.runtime as runtime
from kgen.ops import OPS, PublicCall

NAMESPACE = "kgen"
_EMPTY = inspect.Parameter.empty

# The schema type of each scalar annotation the public calls use (the annotations are
# strings: the runtime's modules defer their evaluation).
SCALARS = {
    "bool": "bool", "int": "int", "float": "float", "str": "str",
    "bool | None": "bool?", "int | None": "int?", "float | None": "float?",
    "str | None": "str?",
    "tuple[int, int] | None": "int[]?",
    "tuple[str | None, str | None]": "str?[]?",
}


@dataclass(frozen=True)
class Arg:
    """One argument of a torch op: its name, schema type and default (``_EMPTY`` where it
    has none), whether it is keyword-only, the call's parameter whose constructor takes it
    (an expanded PagedMetadata), and whether a None means the call's own default."""

    name: str
    type: str
    default: object = _EMPTY
    kw_only: bool = False
    group: str | None = None
    omit_none: bool = False

    def spelled(self) -> str:
        text = f"{self.type} {self.name}"
        return text if self.default is _EMPTY else f"{text}={_literal(self.default)}"


def _literal(v) -> str:
    """A default in the schema's spelling."""
    if v is None or isinstance(v, bool | int | str):
        return repr(v)
    if isinstance(v, float):
        return repr(float(v))
    raise TypeError(f"no schema literal for {v!r}")


def _spellable(v) -> bool:
    return v is None or isinstance(v, bool | int | float | str)


def _constructor(annotation) -> type | None:
    """The class of kgen.runtime an annotation names, where its constructor is a public
    call (PagedMetadata): the op takes that constructor's arguments in its place."""
    cls = getattr(runtime, annotation, None) if isinstance(annotation, str) else None
    init = getattr(cls, "__init__", None)
    return cls if inspect.isclass(cls) and hasattr(init, "__kgen_public__") else None


def _args(call: PublicCall, fn, group: str | None = None, alias: list | None = None):
    """The torch op's arguments for ``fn``'s parameters (a public call, or a class's
    public constructor in the group of the call's parameter ``group``)."""
    alias = [] if alias is None else alias
    arrays = set(fn.__kgen_public__[1]) | set(call.tensors)
    for p in inspect.signature(fn).parameters.values():
        if p.name in ("self", "stream") or p.name in call.leaves:
            continue
        kw = p.kind is p.KEYWORD_ONLY
        if p.name in arrays:
            t = "Tensor"
            if p.name in call.writes:
                t += f"({chr(ord('a') + len(alias))}!)"
                alias.append(p.name)
            if p.default is None or p.name in call.optional:
                t += "?"
            yield Arg(p.name, t, p.default, kw, group)
            continue
        cls = _constructor(p.annotation)
        if cls is not None and group is None:
            yield from _args(call, cls.__init__, p.name, alias)
            continue
        t = SCALARS.get(p.annotation)
        if t is None:
            raise TypeError(f"{call.name}: parameter {p.name} ({p.annotation!r}) has no torch "
                            "schema type (kgen.torch.SCALARS)")
        if p.default is _EMPTY or _spellable(p.default):
            yield Arg(p.name, t, p.default, kw, group)
        elif t.endswith("?"):  # a default the schema cannot spell: None stands for it
            yield Arg(p.name, t, None, kw, group, omit_none=True)
        else:
            raise TypeError(f"{call.name}: parameter {p.name}'s default {p.default!r} has "
                            "no schema spelling, and its type no None to stand for it")


class TorchOp:
    """One public call as ``torch.ops.kgen.<name>``: its schema, its real kernel (the
    call) and its fake kernel (the result's shape and dtype)."""

    def __init__(self, call: PublicCall):
        self.call = call
        self.name = call.name
        fn = getattr(runtime, call.name)
        self.args = tuple(_args(call, fn))
        names = [a.name for a in self.args]
        if len(set(names)) != len(names):
            raise TypeError(f"{call.name}: an argument name repeats in {names}")
        params = inspect.signature(fn).parameters
        tensors = {a.name for a in self.args if a.type.startswith("Tensor")}
        stray = {*call.writes, *call.optional, *call.tensors,
                 *([call.result] if call.result else [])} - tensors
        stray |= set(call.leaves) - set(params)
        if stray:
            raise TypeError(f"{call.name}: the op names arrays the call lacks: "
                            f"{sorted(stray)}")
        # the call's parameters built from some of the op's arguments, by class name
        self.constructors = {p.name: p.annotation for p in params.values()
                             if _constructor(p.annotation) is not None}
        self.positional = tuple(a.name for a in self.args if not a.kw_only)
        self.writes = tuple(call.writes)
        self.schema = self._schema()
        self.op = None  # the torch op, once registered

    def _schema(self) -> str:
        parts, star = [], False
        for a in self.args:
            if a.kw_only and not star:
                parts.append("*")
                star = True
            parts.append(a.spelled())
        return f"({', '.join(parts)}) -> {'Tensor' if self.call.result else '()'}"

    def bound(self, args: tuple, kwargs: dict) -> dict:
        """The op's arguments by name (defaults filled in), as torch passes them."""
        given = dict(zip(self.positional, args, strict=False))
        given.update(kwargs)
        for a in self.args:
            if a.name not in given:
                if a.default is _EMPTY:
                    raise TypeError(f"kgen::{self.name} missing argument {a.name}")
                given[a.name] = a.default
        return given

    def split(self, given: dict) -> tuple[tuple, dict]:
        """``given`` (arguments by name, some left out) as the op takes them: positional
        up to the first one left out, the rest by keyword."""
        pos: list = []
        kw: dict = {}
        for i, a in enumerate(self.args):
            if a.name not in given:
                continue
            if a.kw_only or kw or len(pos) < i:
                kw[a.name] = given[a.name]
            else:
                pos.append(given[a.name])
        return tuple(pos), kw

    def call_kwargs(self, given: dict) -> dict:
        """The kgen call's keyword arguments for the op's: each as it came, a None that
        means the call's default left out, an expanded parameter's object built from its
        arguments (on the current stream, as the call runs)."""
        out: dict = {}
        groups: dict[str, dict] = {}
        for a in self.args:
            v = given[a.name]
            if v is None and a.omit_none:
                continue
            if a.group is None:
                out[a.name] = v
            else:
                groups.setdefault(a.group, {})[a.name] = v
        for name, kw in groups.items():
            out[name] = getattr(runtime, self.constructors[name])(**kw)
        return out

    def real(self, *args, **kwargs):
        """The real kernel: the kgen call (looked up when it runs)."""
        result = getattr(runtime, self.name)(**self.call_kwargs(self.bound(args, kwargs)))
        return result if self.call.result else None

    def fake(self, *args, **kwargs):
        """The fake kernel: a new result shaped and typed as its parameter, or nothing."""
        if not self.call.result:
            return None
        like = self.bound(args, kwargs)[self.call.result]
        return like.new_empty(like.shape)

    def register(self, lib) -> None:
        """Defines the op in ``lib`` (kgen's namespace), its real kernel for every device
        (kgen refuses host memory itself) and its fake kernel."""
        lib.define(self.name + self.schema)
        qualname = f"{NAMESPACE}::{self.name}"
        torch.library.impl(qualname, "default", _named(self.real, self.name), lib=lib)
        torch.library.register_fake(qualname, _named(self.fake, f"{self.name}_fake"), lib=lib)
        self.op = getattr(getattr(torch.ops, NAMESPACE), self.name).default


def _named(method, name: str):
    """``method`` as a plain function called ``name`` (torch names kernels by it)."""
    def fn(*args, **kwargs):
        return method(*args, **kwargs)
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = __name__
    return fn


def torch_ops() -> dict[str, TorchOp]:
    """Every op's public calls (in the registry's order), each once."""
    out: dict[str, TorchOp] = {}
    for d in OPS.values():
        for call in d.public_calls:
            if call.name in out:
                raise TypeError(f"{call.name}: described by two ops")
            out[call.name] = TorchOp(call)
    return out


OPS_BY_NAME: dict[str, TorchOp] = torch_ops()
LIBRARY = torch.library.Library(NAMESPACE, "DEF")  # kept: the ops live as long as it does
for _op in OPS_BY_NAME.values():
    _op.register(LIBRARY)

__all__ = ["LIBRARY", "NAMESPACE", "OPS_BY_NAME", "SCALARS", "TorchOp"]
