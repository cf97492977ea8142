"""Valid host arguments and contract mutations: the pieces the op objects build theirs
from (kgen.ops: ``contract_args``, ``contract_mutations``), and the mutations every op
has. kgen.testing.contracts collects what the ops answer.

Nothing here asks an op object (the op modules import this module, so it imports no
module that imports kgen.ops): a maker reads the valid arguments of the op it is made
for."""

from __future__ import annotations

import types
from dataclasses import dataclass

import numpy as np

from kgen.ir.axes import IoDtype, Position
from kgen.ir.params import PARAMS

# The attention scalars every valid flash argument set passes: the plain path.
NEUTRAL = {name: PARAMS[name].neutral for name in ("attn_sink", "scale")}


def cache_args(k, case, z) -> dict:
    """The cache of a host, device or slots position: each role's rows in its format,
    the fp16 shadows (and the sink and window rows they keep), the per-tensor scales."""
    hd, hk, ms = case.head_dim, case.n_head_kv, case.max_seq
    slots = k.position is Position.SLOTS
    ns = len(case.positions) if slots else 0
    lead = (ns, hk) if slots else (hk,)
    a: dict = {}
    fmt = k.pair
    for role in ("k", "v"):  # each role's rows in its format
        f = fmt.of(role)
        row = f.row_width(hd) if fmt.accepts_head_dim(hd) else hd
        a[f"{role}_cache"] = z((*lead, ms, row), f.dtype)
    for s in fmt.shadow_buffers():
        a[s.name] = z((*lead, getattr(k, s.rows_key), hd), np.float16)
    if fmt.shadows:
        a.update(sink=case.sink, win=case.win)
    a.update(tensor_scales(k, case))
    return a


def tensor_scales(k, case) -> dict:
    """The per-tensor scales of the roles whose format has them."""
    given = {"k_scale": case.k_scale, "v_scale": case.v_scale}
    return {n: given[n] for n in k.pair.scale_scalars()}


# ---- contract mutations: each breaks one contract of a valid launch ---------------------

@dataclass(frozen=True)
class Mutation:
    contract: str
    applies: object  # Kernel -> bool, from the kernel's axes
    make: object     # (Kernel, Case) -> args dict breaking the contract


class ShapeOnly:
    """An array stand-in with a shape and dtype but no storage, for launches too
    large to allocate (bind reads only shape, dtype, ndim, size and flags)."""

    class _Flags:
        c_contiguous = True

    def __init__(self, shape, dtype):
        self.shape = tuple(shape) if np.iterable(shape) else (int(shape),)
        self.dtype = np.dtype(dtype)
        self.ndim, self.size, self.flags = len(self.shape), int(np.prod(self.shape)), self._Flags()


class Placed:
    """A host array (its shape, dtype, layout and contents) at a device address
    ``data.ptr``: what bind reads of a CuPy array, to break an alignment contract."""

    def __init__(self, a: np.ndarray, ptr: int):
        self.host = a
        self.shape, self.dtype, self.strides, self.flags = a.shape, a.dtype, a.strides, a.flags
        self.ndim, self.size = a.ndim, a.size
        self.data = types.SimpleNamespace(ptr=ptr, device_id=0)

    def get(self, stream=None) -> np.ndarray:
        return self.host

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.host, dtype)


PLACED_AT = 0x10000  # a device address on every boundary, the misplaced arrays' base


def always(k) -> bool:
    """Every kernel of the op."""
    return True


class Makers:
    """Mutation makers (``make(k, case)``) over one op's valid arguments."""

    def __init__(self, op):
        self.op = op

    def args(self, k, case, alloc=np.zeros) -> dict:
        """A valid argument set of ``k`` at ``case`` (the op's contract_args)."""
        return self.op.contract_args(k, case, alloc)

    def at(self, **case_kw):
        """The arguments at the case with ``case_kw``."""
        return lambda k, case: self.args(k, case.with_(**case_kw))

    def shape_only(self, **case_kw):
        """Every array of the case (with ``case_kw``) replaced by a ShapeOnly of the same
        shape."""
        return lambda k, case: self.args(k, case.with_(**case_kw), alloc=ShapeOnly)

    def big_head_dim(self, k, case):
        """The case at a head_dim wider than a block's threads (ShapeOnly arrays)."""
        hd = 2048
        return self.shape_only(head_dim=hd)(k, case)

    def replace(self, name, value_fn):
        """The arguments with ``name`` replaced by value_fn(its array, the kernel, the
        case)."""
        def make(k, case):
            a = self.args(k, case)
            a[name] = value_fn(a[name], k, case)
            return a
        return make

    def replace_from_args(self, name, value_fn, **case_kw):
        """The kernel's arguments (at ``case_kw``) with ``name`` replaced by value_fn(its
        value, the arguments)."""
        def make(k, case):
            a = self.args(k, case.with_(**case_kw))
            a[name] = value_fn(a[name], a)
            return a
        return make

    def replace_from_case(self, name, value_fn, **case_kw):
        """The arguments (at ``case_kw``) with ``name`` (a callable of the kernel: its
        name) replaced by value_fn(its array, case)."""
        def make(k, case):
            c = case.with_(**case_kw)
            a = self.args(k, c)
            n = name(k) if callable(name) else name
            a[n] = value_fn(a[n], c)
            return a
        return make


def strided(a, k, case):
    """An array of ``a``'s shape whose rows' elements are two apart."""
    wide = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), a.dtype)
    return wide[..., ::2]


def zeros_like_shape(shape_fn):
    return lambda x, a: np.zeros(shape_fn(tuple(x.shape)), x.dtype)


def other_elem(x, a):
    """The same shape in another element type (kgen.ir.axes.IoDtype) than ``x``'s."""
    other = next(d for d in IoDtype if np.dtype(d.fmt.dtype) != x.dtype)
    return np.zeros(x.shape, np.dtype(other.fmt.dtype))


def grown(axis, by=1):
    """Zeros of an array's shape with ``by`` more along ``axis``."""
    def grow(a, c):
        shape = list(a.shape)
        shape[axis] += by
        return np.zeros(shape, a.dtype)
    return grow


def huge_pages(x, a):
    """Pages of ``x``'s rows too many for an int32 position."""
    return ShapeOnly((2**20, 2**12, x.shape[2]), x.dtype)


# ---- the mutations every op has, on the array and integer arguments the op names ------

def argument_mutations(op) -> dict[str, Mutation]:
    """An op's first mutations: its array argument not an array, its integer argument
    (if it has one) not an integer."""
    m = Makers(op)

    def not_an_integer(k, case):
        a = m.args(k, case)
        name = op.mutated_integer(k)
        a[name] = a[name] + 0.5
        return a
    return {
        "not_an_array": Mutation("array", always, lambda k, c: {
            **m.args(k, c), op.mutated_array: [0.0, 1.0]}),
        "not_an_integer": Mutation("type", lambda k: op.mutated_integer(k) is not None,
                                   not_an_integer),
    }


def widest_array(op, k) -> tuple[str, int]:
    """The array parameter of ``k`` with the widest alignment contract (the first of
    them) and its bytes (kgen.ir.signature.Param.align)."""
    p = max((p for p in op.params(k) if p.is_pointer), key=lambda p: p.align)
    return p.name, p.align


def layout_mutations(op) -> dict[str, Mutation]:
    """An op's array argument as float64, and strided (after its mutations of scalars
    and sizes, if any); its most aligned array half its alignment off its boundary."""
    m = Makers(op)

    def misaligned(k, case):
        a = m.args(k, case)
        name, align = widest_array(op, k)
        a[name] = Placed(np.asarray(a[name]), PLACED_AT + align // 2)
        return a

    def wrong_dtype(k, case):
        a = m.args(k, case)
        name = op.mutated_array
        a[name] = a[name].astype(np.float64)
        return a

    def non_contiguous(k, case):
        a = m.args(k, case)
        name = op.mutated_array
        a[name] = strided(a[name], k, case)
        return a
    return {
        "wrong_dtype": Mutation("dtype", always, wrong_dtype),
        "non_contiguous": Mutation("contiguous", always, non_contiguous),
        "misaligned": Mutation("alignment", lambda k: widest_array(op, k)[1] > 1, misaligned),
    }


def cache_mutations(op) -> dict[str, Mutation]:
    """The mutations of the KV cache an op reads or writes (its ``cache``): the format's
    per-tensor scale, row blocks and shadows, a device or slots position (the op places
    each among its own)."""
    m = Makers(op)

    def device_pos(k) -> bool:
        return k.position in (Position.DEVICE, Position.SLOTS)
    return {
        "tensor_scale_not_positive": Mutation(
            "k_scale", lambda k: "k_scale" in k.pair.scale_scalars(),
            lambda k, c: {**m.args(k, c), "k_scale": 0.0}),
        "row_format_head_dim": Mutation(
            "row format", lambda k: k.pair.block > 1,
            lambda k, c: m.args(k, c.with_(head_dim=k.pair.block + k.pair.block // 2))),
        "sink_rows": Mutation("sink rows", lambda k: k.pair.shadows, lambda k, c: m.args(
            k, c.with_(sink=k.sink_rows + 1))),
        "window_ring": Mutation("window ring", lambda k: k.pair.shadows, lambda k, c: m.args(
            k, c.with_(win=k.ring_rows + 1))),
        "negative_device_pos": Mutation("position", device_pos, m.replace(
            "pos", lambda a, k, c: np.full_like(a, -1))),
    }
