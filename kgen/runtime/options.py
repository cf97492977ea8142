"""A cache call's arguments, checked as the kernels receive them, and its attention
options translated: which option axes the kernels must have, and the launch
arguments each kernel takes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kgen.formats import as_pair
from kgen.ir.axes import IoDtype
from kgen.ir.params import INT_MAX, NO_WINDOW, PARAMS
from kgen.ops import get
from kgen.runtime import convention, device
from kgen.runtime.contracts import ContractError
from kgen.runtime.pending import Pending


def is_int(v) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def count(name: str, v, lo: int = 0, who: str = "KVCache", hi: int = INT_MAX) -> int:
    """An integer the kernels receive as a C int, in [``lo``, ``hi``]."""
    if not is_int(v) or not lo <= v <= hi:
        raise ContractError(who, "range", f"{name} must be an integer in [{lo}, {hi}], "
                            f"not {v!r}")
    return int(v)


def flag(name: str, v, who: str) -> int:
    """A yes/no argument (a bool, or the int 0 or 1) as the C int a kernel takes."""
    if isinstance(v, bool | np.bool_):
        return int(v)
    if isinstance(v, int | np.integer) and int(v) in (0, 1):
        return int(v)
    raise ContractError(who, "type", f"{name} must be True or False, not {v!r}")


def io_dtype(name: str, a, who: str) -> IoDtype:
    """The element type an array holds (kgen.ir.axes.IoDtype: float32 f32, uint16 bf16
    bit patterns, float16 f16), by the format's NumPy dtype; a ContractError otherwise."""
    dt = getattr(a, "dtype", None)
    if dt is None or not hasattr(a, "shape"):
        raise ContractError(who, "array", f"{name} must be an array, not {type(a).__name__}")
    for d in IoDtype:
        if np.dtype(dt) == np.dtype(d.fmt.dtype):
            return d
    names = ", ".join(f"{np.dtype(d.fmt.dtype).name} ({d.value})" for d in IoDtype)
    raise ContractError(who, "dtype", f"{name} must be one of {names}, not {dt}")


def dtype_name(v, who: str) -> IoDtype:
    """An element type named by the caller (an IoDtype or its spelling: f32, bf16, f16)."""
    try:
        return IoDtype(v)
    except ValueError:
        raise ContractError(who, "dtype", f"dtype must be one of "
                            f"{', '.join(d.value for d in IoDtype)}, not {v!r}") from None


def positive(name: str, v, who: str = "KVCache") -> int:
    return count(name, v, 1, who)


def given_plan(kps, splits_cap, who: str = "KVCache") -> tuple[int | None, int | None]:
    """The plan values a caller gave, checked (positive ints); None where not given."""
    return (None if kps is None else positive("kps", kps, who),
            None if splits_cap is None else positive("splits_cap", splits_cap, who))


def groups(n_head, n_head_kv: int, who: str = "KVCache") -> int:
    """q heads per KV head (the kernels' kv_groups): n_head a positive multiple of
    n_head_kv."""
    if not is_int(n_head) or n_head < 1 or n_head % n_head_kv:
        raise ContractError(who, "GQA", f"n_head = {n_head} is not a multiple of "
                            f"n_head_kv = {n_head_kv}")
    return int(n_head) // n_head_kv


NO_SCALES = (PARAMS["k_scale"].neutral, PARAMS["v_scale"].neutral)  # (k_scale, v_scale)


def scales(fmt, k_scale, v_scale, who: str = "KVCache") -> tuple[float, float]:
    """(k_scale, v_scale) as the kernels receive them; a format without per-tensor
    scales takes only the neutral ones (``fmt``: a format, or a cache's pair, whose
    roles each take their own format's)."""
    fmt = as_pair(fmt)
    if not fmt.tensor_scales and (k_scale, v_scale) != NO_SCALES:
        raise ContractError(who, "scales", f"kv = {fmt.name} has no per-tensor scales; "
                            f"k_scale and v_scale must be {NO_SCALES[0]}, not "
                            f"{k_scale!r}, {v_scale!r}")
    for name, value, neutral in zip(("k_scale", "v_scale"), (k_scale, v_scale), NO_SCALES,
                                    strict=True):
        if fmt.tensor_scales and name not in fmt.scale_scalars() and value != neutral:
            raise ContractError(who, "scales", f"the {name[0].upper()} rows of kv = "
                                f"{fmt.name} have no per-tensor scale; {name} must be "
                                f"{neutral}, not {value!r}")
    return param("k_scale", k_scale), param("v_scale", v_scale)


_NO_SINKS: dict[tuple[int, int], object] = {}


def no_sinks(n_head: int):
    """A device array of -inf sink logits (one per q head), made once per device."""
    cp = device.cupy()
    key = (n_head, cp.cuda.runtime.getDevice())
    if key not in _NO_SINKS:
        _NO_SINKS[key] = cp.full(n_head, -np.inf, cp.float32)
    return _NO_SINKS[key]


def finite32(name: str, v, positive: bool, lo: float = 0) -> float:
    """A float scalar as the kernels receive it: finite in float32, > lo or >= lo."""
    ok = isinstance(v, int | float | np.number) and not isinstance(v, bool | np.bool_)
    if ok:
        with np.errstate(over="ignore"):
            f = float(np.float32(v))
        ok = math.isfinite(f) and (f > lo if positive else f >= lo)
    if not ok:
        raise ContractError("KVCache", name, f"{name} must be finite in float32 and "
                            f"{'>' if positive else '>='} {lo}, not {v!r}")
    return float(v)


def param(name: str, v, label: str | None = None):
    """A parameter of kgen.ir.params as the kernels receive it, in its range
    (``label``: how the message names it, if not by its name)."""
    p = PARAMS[name]
    if p.kind is int:
        return count(label or name, v, p.lo, hi=p.hi)
    return finite32(label or name, v, p.positive, p.lo)


@dataclass(frozen=True)
class Options:
    """The attention options of one call, checked; which option axes the kernels
    must have for them, and the launch arguments each kernel takes."""

    attn_sink: int = PARAMS["attn_sink"].default
    attn_win: int = PARAMS["attn_win"].default
    scale: float | None = PARAMS["scale"].default
    window: tuple[int, int] | None = None  # (win_left, win_right); None: no window
    softcap: float = PARAMS["softcap"].default
    sinks: object = None
    causal: bool = True

    @classmethod
    def checked(cls, n_head, attn_sink, attn_win, scale, window, softcap, sinks, causal):
        attn_sink, attn_win = param("attn_sink", attn_sink), param("attn_win", attn_win)
        if scale is not None:
            scale = param("scale", scale)
        window = convention.window_size(window, "KVCache")  # -1: that side unbounded
        if window is not None:
            window = (param("win_left", window[0], "window left"),
                      param("win_right", window[1], "window right"))
            if attn_win:
                raise ContractError("KVCache", "window", "give either window_size (key-exact) or "
                                    "attn_win (tile-granular), not both")
        softcap = param("softcap", softcap)
        if sinks is not None and (getattr(sinks, "dtype", None) != np.float32 or
                                  tuple(getattr(sinks, "shape", ())) != (n_head,)):
            raise ContractError("KVCache", "sinks", f"sinks must be float32 [{n_head}] (one "
                                f"logit per q head), not {getattr(sinks, 'dtype', sinks)!r} "
                                f"{tuple(getattr(sinks, 'shape', ()))}")
        if not isinstance(causal, bool | np.bool_):
            raise ContractError("KVCache", "causal", f"causal must be True or False, not "
                                f"{causal!r}")
        return cls(attn_sink, attn_win, scale, window, softcap, sinks, bool(causal))

    @property
    def window_neutral(self) -> bool:
        """A key-exact window that removes no key: no bound on the left, and under a
        full mask none on the right (causally nothing lies right of the query). The
        plain kernels serve it, so it changes no bit."""
        left, right = self.window
        return left >= INT_MAX and (self.causal or right >= INT_MAX)

    def needs(self, role: str) -> tuple[tuple[str, str], ...]:
        """The option axes the kernel serving ``role`` must have."""
        out = []
        if role.startswith(("prefill", "decode")):  # *_dev, *_slots and *_paged too
            if self.window is not None and not self.window_neutral:
                out.append(("window", "exact"))
            if self.softcap > 0:
                out.append(("softcap", "tanh"))
        if role.startswith("prefill") and not self.causal:
            out.append(("mask", "full"))
        if self.sinks is not None and role in ("prefill", "prefill_paged", "combine",
                                               "combine_dev"):
            out.append(("sinks", "learned"))
        return tuple(out)

    def kwargs(self, k, n_head: int = 0) -> dict:
        """The keyword arguments a flash kernel with ``k``'s axes takes (``n_head``: the
        q heads, for the neutral sinks of a kernel that has them)."""
        out = {"attn_sink": self.attn_sink, "scale": self.scale}
        if k.window.value == "exact":
            left, right = self.window or NO_WINDOW
            out.update(win_left=left, win_right=right)
        else:
            out["attn_win"] = self.attn_win
        if k.softcap.value == "tanh":
            out["softcap"] = self.softcap
        if k.sinks.value == "learned" and get(k.op).sinks_keyword:
            # A kernel chosen for another option may carry sinks nobody asked for: -inf
            # sinks change no bit (made once the call is checked).
            out["sinks"] = self.sinks if self.sinks is not None else \
                Pending((n_head,), np.float32, lambda: no_sinks(n_head))
        return out

    def combine_arrays(self, k) -> tuple:
        return (self.sinks,) if k.sinks.value == "learned" else ()
