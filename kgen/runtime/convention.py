"""The one convention of every public kgen call, written once.

Every public entry point (the ops in kgen.runtime, the cache objects' methods) is
wrapped by :func:`public`, which applies, before the call's own contracts run:

* **Arrays from any GPU library.** An array argument may be a ``cupy.ndarray``, a
  ``torch.Tensor`` on a CUDA device, any object with ``__cuda_array_interface__``
  (Numba, PyCUDA, ...) or ``__dlpack__`` (JAX, ...), or a DLPack capsule. Each becomes a
  CuPy view of the same memory (no copy; strides kept); the call's contracts then read
  it as they read a CuPy array. ``torch.bfloat16`` arrives as its bit patterns
  (uint16), the form kgen's bf16 kernels take. Host memory (NumPy, a CPU tensor) and
  anything that is not an array are a ContractError.
* **The caller's stream.** ``stream=`` may be a CuPy stream, a ``torch.cuda.Stream`` or
  a raw ``cudaStream_t`` handle (an int). Without one, a call given torch tensors runs
  on torch's current stream for their device; otherwise on CuPy's current stream. The
  whole call (its allocations, its launches) runs on that stream.
* **Results in the caller's library.** Where torch tensors came in, the arrays a call
  returns are torch tensors (views of the same memory; bf16 as ``torch.bfloat16``).
* **Arguments that bind.** A call whose arguments do not bind to the call's parameters (an
  unknown keyword, too many positional arguments, one missing or given twice: Python's
  TypeError) is a ContractError naming the argument, before anything is converted.
* **One read-back switch.** ``validate`` (see :func:`read_back`): None by default, which
  reads device index arrays back for their contracts unless the stream is capturing a
  CUDA graph, so a call captures with its defaults.
* **The model's dtypes.** An argument declared ``widen`` (the caches' q, k and v: their
  kernels read float32) takes float32, float16 or bfloat16; 16-bit values are widened
  exactly to float32 on the call's stream, and the call's float32 result is returned in
  the first such argument's element type (bf16 rounded to nearest even, as
  kgen.formats.bf16 rounds).
* **Aligned arrays.** An array the convention itself copies on the GPU (a widened
  argument, ``out=``) starts on its element's boundary, checked before anything is
  widened; every array a kernel reads or writes starts where its kernel's alignment
  contract asks (kgen.runtime.bind, with the kernel's names for its arguments).

The scalar conventions are single functions here too: :func:`softmax_scale` (None
means ``head_dim ** -0.5``) and :func:`window_size` (FlashAttention's ``(left,
right)``, -1 for no bound on that side).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections.abc import Callable, Iterable

import numpy as np

from kgen.formats import bf16
from kgen.ir.params import INT_MAX
from kgen.runtime import device
from kgen.runtime.contracts import Checker, ContractError

# ---- arrays --------------------------------------------------------------------------

_F32, _F16, _BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.uint16)


def _torch():
    """The torch module if the caller has imported it (kgen never imports it itself)."""
    return sys.modules.get("torch")


def is_torch(x) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def _from_torch(name: str, x, who: str):
    t = _torch()
    if x.device.type != "cuda":
        raise ContractError(who, "device", f"{name} must be on a CUDA device, not "
                            f"{x.device}")
    cp = device.cupy()
    bits = x.dtype == t.bfloat16
    if bits:
        x = x.view(t.int16)  # cupy has no bfloat16: its bit patterns, as kgen's bf16 takes
    try:
        dt = np.dtype(str(x.dtype).removeprefix("torch."))
    except TypeError:
        raise ContractError(who, "dtype", f"{name} holds {x.dtype}, which kgen's kernels "
                            "do not read") from None
    if bits:
        dt = _BF16
    n = x.numel()
    item = dt.itemsize
    if n == 0:
        return cp.empty(tuple(x.shape), dt)
    # The extent the view spans, from its first element's address (strides >= 0 in torch).
    span = (1 + sum((s - 1) * st for s, st in zip(x.shape, x.stride(), strict=True))) * item
    mem = cp.cuda.UnownedMemory(x.data_ptr(), span, x, x.device.index)
    return cp.ndarray(tuple(x.shape), dt, cp.cuda.MemoryPointer(mem, 0),
                      strides=tuple(s * item for s in x.stride()))


def as_device_array(name: str, x, who: str):
    """``x`` as a CuPy array on the GPU (the same memory), or a ContractError (host
    memory is refused before CuPy is asked for: that check needs none)."""
    if isinstance(x, _ndarray()):
        return x
    if isinstance(x, np.ndarray | np.generic) or (
            hasattr(x, "__array_interface__") and not hasattr(x, "__cuda_array_interface__")):
        raise ContractError(who, "device", f"{name} must be a GPU array (CuPy, torch on "
                            f"CUDA, DLPack), not host memory ({type(x).__name__})")
    if is_torch(x):
        return _from_torch(name, x, who)
    cp = device.cupy()
    try:
        if hasattr(x, "__cuda_array_interface__"):
            return cp.asarray(x)
        if hasattr(x, "__dlpack__") or type(x).__name__ == "PyCapsule":
            return cp.from_dlpack(x)
    except (TypeError, ValueError, BufferError, RuntimeError) as e:
        raise ContractError(who, "array", f"{name} cannot be read as a GPU array: {e}") \
            from None
    raise ContractError(who, "array", f"{name} must be a GPU array (CuPy, torch on CUDA, "
                        f"__cuda_array_interface__ or DLPack), not {type(x).__name__}")


def _on_gpu(x) -> bool:
    """Whether ``x`` is an array some GPU library holds (not host values)."""
    if is_torch(x):
        return x.device.type == "cuda"
    return hasattr(x, "__cuda_array_interface__") or (
        hasattr(x, "__dlpack__") and not hasattr(x, "__array_interface__"))


def to_torch(a):
    """A CuPy array as a torch tensor over the same memory (uint16 as torch.bfloat16)."""
    t = _torch()
    if a.dtype == _BF16:
        return t.from_dlpack(a.view(np.int16)).view(t.bfloat16)
    return t.from_dlpack(a)


def element_aligned(name: str, a, who: str) -> None:
    """``a`` (a device array) starts on its element's boundary."""
    Checker(who).aligned(name, a, a.dtype.itemsize)


def widen(a):
    """A float16 or bf16 (uint16 bits) array's values widened exactly to float32 on the
    current stream; any other array as it is (the call's contracts judge it)."""
    if a.dtype == _F16:
        return a.astype(np.float32)
    if a.dtype == _BF16:
        return bf16.decode(a, xp=device.cupy())
    return a


def narrow(a, dtype):
    """A float32 result in ``dtype`` (float16 by IEEE rounding, bf16 bits rounded to
    nearest even)."""
    if dtype == _F32 or a.dtype != _F32:
        return a
    if dtype == _BF16:
        return bf16.encode(a, xp=device.cupy())
    return a.astype(dtype)


_ND: list = [None, None]  # (device.cupy as last seen, its ndarray type)


def _ndarray():
    """The current CuPy's ndarray type (device.cupy may be a stand-in: asked again when
    it changes)."""
    f = device.cupy
    if _ND[0] is not f:
        try:
            nd = f().ndarray
        except ModuleNotFoundError:  # no CuPy: nothing is plain; the arrays' checks speak
            nd = _NoCupy
        _ND[:] = [f, nd]
    return _ND[1]


class _NoCupy:
    """The ndarray type where CuPy is not installed: no argument is one."""


# ---- streams -------------------------------------------------------------------------

_EXTERNAL: dict[tuple[int, int], object] = {}


def _external(handle: int, dev: int):
    s = _EXTERNAL.get((handle, dev))
    if s is None:
        s = _EXTERNAL[(handle, dev)] = device.cupy().cuda.ExternalStream(handle, dev)
    return s


def resolve_stream(stream, torch_device: int | None, who: str):
    """The CuPy stream a call runs on: ``stream`` as given (a CuPy stream, a torch stream,
    a raw handle), else torch's current stream where torch tensors came in (on their
    device), else None (CuPy's current stream)."""
    cp = device.cupy()
    if stream is None:
        if torch_device is None:
            return None
        t = _torch()
        return _external(int(t.cuda.current_stream(torch_device).cuda_stream), torch_device)
    if isinstance(stream, cp.cuda.Stream | cp.cuda.ExternalStream):
        return stream
    handle = getattr(stream, "cuda_stream", stream)  # torch.cuda.Stream
    if isinstance(handle, int | np.integer) and not isinstance(handle, bool) and handle >= 0:
        return _external(int(handle), cp.cuda.runtime.getDevice())
    raise ContractError(who, "stream", "stream must be a CuPy stream, a torch.cuda.Stream or "
                        f"a cudaStream_t handle (int), not {type(stream).__name__}")


# ---- scalars -------------------------------------------------------------------------

def softmax_scale(scale, head_dim: int):
    """``scale``, or ``head_dim ** -0.5`` for None (a given scale is checked by the kernel's
    own contract: finite and > 0)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def window_size(win, who: str) -> tuple[int, int] | None:
    """FlashAttention's ``window_size=(left, right)``: a query at p sees keys in
    [p - left, p + right], -1 on a side meaning no bound there (read as INT_MAX, the
    kernels' unbounded; (-1, -1) is then no window at all). None stays None. The shape
    is checked here, each side's range by the call's own parameters (win_left,
    win_right: kgen.ir.params)."""
    if win is None:
        return None
    ok = isinstance(win, tuple | list) and len(win) == 2 and all(
        isinstance(v, int | np.integer) and not isinstance(v, bool) for v in win)
    if not ok:
        raise ContractError(who, "window_size", "window_size must be (left, right), two "
                            f"integers (-1: no bound on that side), not {win!r}")
    return tuple(INT_MAX if int(v) == -1 else int(v) for v in win)


def capturing(stream) -> bool:
    """Whether ``stream`` (None: CuPy's current stream) is capturing a CUDA graph."""
    cp = device.cupy()
    ptr = stream.ptr if stream is not None else cp.cuda.get_current_stream().ptr
    return cp.cuda.runtime.streamIsCapturing(ptr) != 0


def read_back(validate, stream, who: str) -> bool:
    """The one read-back switch (``validate``) of every call whose contracts can read
    device arrays back (positions, tables, lengths, slots): True reads them, False
    trusts the caller, None (the default) reads them unless ``stream`` is capturing a
    CUDA graph (a read-back there would break the capture; the caller then owns their
    contents)."""
    if validate is None:
        return not capturing(stream)
    if type(validate) is not bool:
        raise ContractError(who, "type", f"validate must be True, False or None, not "
                            f"{validate!r}")
    return validate


# ---- the wrapper ---------------------------------------------------------------------

class _Call:
    """What one public call learned of its arrays: torch's device, if torch came in; the
    dtype the result returns in (a widened argument's); whether an argument is widened
    (which allocates)."""

    __slots__ = ("torch_device", "result_dtype", "widens", "given")

    def __init__(self):
        self.torch_device: int | None = None
        self.result_dtype = None
        self.widens = False
        self.given: dict[int, object] = {}  # id(view) -> the caller's own array


def public(who: str, arrays: Iterable[str] = (), widen_args: Iterable[str] = (),
           host_ok: Iterable[str] = (), out_like: str | None = None) -> Callable:
    """Decorate a public entry point: its parameters named in ``arrays`` (may be None)
    take any GPU array (converted as the module says), those in ``widen_args`` also the
    model's 16-bit dtypes (widened; the first one given sets the result's dtype), those
    in ``host_ok`` a GPU array or host values (a list of positions, say: left as they
    are); ``stream`` is resolved; returned arrays come back in the caller's library.
    ``out_like``: the call returns an array shaped as this parameter and takes ``out=``
    (an array of that shape, float32, float16 or bfloat16, checked before the call runs)
    that the result is written into and returned as."""
    widen_args, host_ok = tuple(widen_args), frozenset(host_ok)
    touched = tuple(dict.fromkeys((*widen_args, *arrays, *host_ok)))

    def wrap(fn):
        sig = inspect.signature(fn)
        names = list(sig.parameters)
        if out_like is not None and "out" in names:
            raise TypeError(f"{fn.__qualname__}: takes out= itself; out_like is for calls "
                            "that do not")
        method = names[:1] == ["self"]
        pos = {n: i for i, n in enumerate(names)}
        unknown = set(touched) - set(pos)
        if unknown:
            raise TypeError(f"{fn.__qualname__}: no parameters {sorted(unknown)}")
        if "stream" not in pos:
            raise TypeError(f"{fn.__qualname__}: a public call takes stream=")
        P = inspect.Parameter
        if any(p.kind in (P.POSITIONAL_ONLY, P.VAR_POSITIONAL, P.VAR_KEYWORD)
               for p in sig.parameters.values()):
            raise TypeError(f"{fn.__qualname__}: a public call's parameters are named (no "
                            "positional-only parameters, *args or **kwargs)")
        # What Python checks when it binds a call to fn, precomputed for each count of
        # positional arguments: the names then left to keywords, those of them without a
        # default (sig.bind costs microseconds a call; these are two set comparisons).
        slots = sum(p.kind is P.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())
        by_keyword = [frozenset(names[n:]) for n in range(slots + 1)]
        needed = [frozenset(x for x in names[n:] if sig.parameters[x].default is P.empty)
                  for n in range(slots + 1)]
        takes = ", ".join([*names[1 if method else 0:], *(["out"] if out_like else [])])

        def binds(args: tuple, kw: dict) -> bool:
            """Whether Python binds ``fn(*args, **kw)``: no argument too many, none unknown
            or given twice, none missing."""
            n = len(args)
            if n > slots:
                return False
            given = kw.keys()
            return given <= by_keyword[n] and needed[n] <= given

        def unbound(args, kw) -> None:
            """A ContractError naming the argument where ``fn(*args, **kw)`` does not bind
            (Python's own words for it); nothing where it does."""
            try:
                sig.bind(*args, **kw)
            except TypeError as e:
                raise ContractError(who, "signature", f"{e} (the call takes {takes})") \
                    from None

        def convert(call: _Call, names, args: list, kw: dict, step) -> None:
            """``step`` applied to each of ``names`` given (positionally or by keyword)."""
            nd = _ndarray()
            for name in names:
                i = pos[name]
                v = args[i] if i < len(args) else kw.get(name)
                if v is None:
                    continue
                v = step(call, name, v, name, nd)
                if i < len(args):
                    args[i] = v
                else:
                    kw[name] = v

        def view(call: _Call, label: str, v, name: str, ndarray=None):
            """The argument as a CuPy view (no GPU work)."""
            if type(v) is not ndarray:
                if name in host_ok and not _on_gpu(v):
                    return v
                if call.torch_device is None and is_torch(v) and v.device.type == "cuda":
                    call.torch_device = v.device.index
                a = as_device_array(label, v, who)
                call.given[id(a)] = v
                v = a
            if name in widen_args:
                dt = v.dtype
                if call.result_dtype is None and dt in (_F32, _F16, _BF16):
                    call.result_dtype = dt
                if dt is not _F32 and dt in (_F16, _BF16):
                    call.widens = True
                    element_aligned(label, v, who)  # before widening reads it
            return v

        def widened(call: _Call, label: str, v, name: str, ndarray=None):
            return widen(v)

        def back(call: _Call, r):
            cp = device.cupy()
            if isinstance(r, cp.ndarray):
                mine = call.given.get(id(r))
                if mine is not None:  # an argument (out=): the caller's own object
                    return mine
                if call.result_dtype is not None:
                    r = narrow(r, call.result_dtype)
                return to_torch(r) if call.torch_device is not None else r
            if type(r) is tuple:  # (out, lse); a Launch (a named tuple) stays as it is
                return tuple(back(call, x) for x in r)
            return r

        def into(call: _Call, out, args: list, kw: dict):
            """``out`` as a CuPy view, checked against the result's shape before the call
            (which then changes state) runs."""
            mine = as_device_array("out", out, who)
            i = pos[out_like]
            like = args[i] if i < len(args) else kw.get(out_like)
            want = tuple(getattr(like, "shape", ()))
            if tuple(mine.shape) != want or mine.dtype not in (_F32, _F16, _BF16):
                raise ContractError(who, "out", f"out must be float32, float16 or bfloat16 "
                                    f"of {out_like}'s shape {want}, not {mine.dtype} "
                                    f"{tuple(mine.shape)}")
            element_aligned("out", mine, who)  # the result is copied into it
            if call.torch_device is None and is_torch(out):
                call.torch_device = out.device.index
            return mine

        def run(call: _Call, args: list, kw: dict, out=None, mine=None):
            if call.widens and not binds(args, kw):  # refused before widening allocates
                unbound(args, kw)
            convert(call, widen_args, args, kw, widened)  # on the call's stream
            try:
                r = fn(*args, **kw)
            except TypeError:
                unbound(args, kw)
                raise
            if mine is None:
                return back(call, r)
            mine[...] = narrow(r, mine.dtype)
            return out

        at = tuple(pos[n] for n in touched)  # where the touched parameters sit
        widen_at = frozenset(pos[n] for n in widen_args)
        at_stream = pos["stream"]

        def plain(args: tuple, kw: dict) -> bool:
            """Whether the call needs nothing of the convention: every array given is a
            CuPy array (float32 where it would be widened), no stream is named. The
            common case of a CuPy caller, checked first, at the cost of a few type
            checks (a result is then returned as the call made it)."""
            nd = _ndarray()
            n = len(args)
            if at_stream < n and args[at_stream] is not None:
                return False
            for i in at:
                if i < n:
                    v = args[i]
                    if v is not None and (type(v) is not nd or (
                            i in widen_at and v.dtype is not _F32)):
                        return False
            if kw:
                if kw.get("stream") is not None:
                    return False
                for name in touched:
                    v = kw.get(name)
                    if v is not None and (type(v) is not nd or (
                            name in widen_args and v.dtype is not _F32)):
                        return False
            return True

        @functools.wraps(fn)
        def entry(*args, **kw):
            out = kw.pop("out", None) if out_like is not None else None
            if out is None and plain(args, kw):
                try:  # free unless raised: a TypeError binding the arguments comes before fn runs
                    return fn(*args, **kw)
                except TypeError:
                    unbound(args, kw)
                    raise
            call = _Call()
            args = list(args)
            convert(call, touched, args, kw, view)
            mine = None if out is None else into(call, out, args, kw)
            i = pos["stream"]
            given = args[i] if i < len(args) else kw.get("stream")
            stream = resolve_stream(given, call.torch_device, who)
            if stream is None:
                return run(call, args, kw, out, mine)
            if i < len(args):
                args[i] = stream
            else:
                kw["stream"] = stream
            with stream:
                return run(call, args, kw, out, mine)

        if out_like is not None:  # the signature a caller sees: out= besides fn's own
            entry.__signature__ = sig.replace(parameters=[
                *sig.parameters.values(),
                inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default=None)])

        entry.__kgen_public__ = (who, frozenset(touched), method)
        return entry

    return wrap
