"""A cache call's arguments, checked as the kernels receive them, and its attention
options translated: which option axes the kernels must have, and the launch
arguments each kernel takes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kgen.ir.axes import Op
from kgen.runtime import device
from kgen.runtime.bind import INT_MAX
from kgen.runtime.contracts import ContractError


def is_int(v) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def count(name: str, v, lo: int = 0, who: str = "KVCache") -> int:
    """An integer the kernels receive as a C int, at least ``lo``."""
    if not is_int(v) or not lo <= v <= INT_MAX:
        raise ContractError(who, "range", f"{name} must be an integer in [{lo}, {INT_MAX}], "
                            f"not {v!r}")
    return int(v)


def positive(name: str, v, who: str = "KVCache") -> int:
    return count(name, v, 1, who)


_NO_SINKS: dict[tuple[int, int], object] = {}


def no_sinks(n_head: int):
    """A device array of -inf sink logits (one per q head), made once per device."""
    cp = device.cupy()
    key = (n_head, cp.cuda.runtime.getDevice())
    if key not in _NO_SINKS:
        _NO_SINKS[key] = cp.full(n_head, -np.inf, cp.float32)
    return _NO_SINKS[key]


def finite32(name: str, v, positive: bool) -> float:
    """A float scalar as the kernels receive it: finite in float32, > 0 or >= 0."""
    ok = isinstance(v, int | float | np.number) and not isinstance(v, bool | np.bool_)
    if ok:
        with np.errstate(over="ignore"):
            f = float(np.float32(v))
        ok = math.isfinite(f) and (f > 0 if positive else f >= 0)
    if not ok:
        raise ContractError("KVCache", name, f"{name} must be finite in float32 and "
                            f"{'> 0' if positive else '>= 0'}, not {v!r}")
    return float(v)


@dataclass(frozen=True)
class Options:
    """The attention options of one call, checked; which option axes the kernels
    must have for them, and the launch arguments each kernel takes."""

    attn_sink: int = 0
    attn_win: int = 0
    scale: float | None = None
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    sinks: object = None
    causal: bool = True

    @classmethod
    def checked(cls, n_head, attn_sink, attn_win, scale, window, softcap, sinks, causal):
        attn_sink, attn_win = count("attn_sink", attn_sink), count("attn_win", attn_win)
        if scale is not None:
            scale = finite32("scale", scale, positive=True)
        if window is not None:
            if not (isinstance(window, tuple | list) and len(window) == 2):
                raise ContractError("KVCache", "window", "window is (left, right), distances "
                                    f"from the query (FlashAttention's window_size), not "
                                    f"{window!r}")
            window = (count("window left", window[0]), count("window right", window[1]))
            if attn_win:
                raise ContractError("KVCache", "window", "give either window (key-exact) or "
                                    "attn_win (tile-granular), not both")
        softcap = finite32("softcap", softcap, positive=False)
        if sinks is not None and (getattr(sinks, "dtype", None) != np.float32 or
                                  tuple(getattr(sinks, "shape", ())) != (n_head,)):
            raise ContractError("KVCache", "sinks", f"sinks must be float32 [{n_head}] (one "
                                f"logit per q head), not {getattr(sinks, 'dtype', sinks)!r} "
                                f"{tuple(getattr(sinks, 'shape', ()))}")
        return cls(attn_sink, attn_win, scale, window, softcap, sinks, bool(causal))

    def needs(self, role: str) -> tuple[tuple[str, str], ...]:
        """The option axes the kernel serving ``role`` must have."""
        out = []
        if role.startswith(("prefill", "decode")):  # *_dev, *_slots and *_paged too
            if self.window is not None:
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
            left, right = self.window or (INT_MAX, INT_MAX)
            out.update(win_left=left, win_right=right)
        else:
            out["attn_win"] = self.attn_win
        if k.softcap.value == "tanh":
            out["softcap"] = self.softcap
        if k.sinks.value == "learned" and k.op is Op.FLASH:
            # A kernel chosen for another option may carry sinks nobody asked for: -inf
            # sinks change no bit.
            out["sinks"] = self.sinks if self.sinks is not None else no_sinks(n_head)
        return out

    def combine_arrays(self, k) -> tuple:
        return (self.sinks,) if k.sinks.value == "learned" else ()
