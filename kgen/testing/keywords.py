"""What a case gives a kernel beyond its arrays, as the launcher and as the NumPy
reference take it: the attention options the kernel has, the format's own
scalars, and the learned sink logits."""

from __future__ import annotations

import numpy as np

from kgen.ir.axes import Mask, Mode, SoftCap, Window
from kgen.ir.kernel import Kernel
from kgen.ir.params import NO_WINDOW
from kgen.testing.case import Case


def options(k: Kernel, case: Case) -> dict:
    """The window and soft-cap arguments a flash kernel takes, from the case."""
    out: dict = {}
    if k.window is Window.EXACT:
        out["win_left"], out["win_right"] = case.window or NO_WINDOW
    else:
        out["attn_win"] = case.attn_win
    if k.softcap is SoftCap.TANH:
        out["softcap"] = case.softcap
    return out


def ref_options(k: Kernel, case: Case) -> dict:
    """The same options as the NumPy reference takes them."""
    # An exact-window kernel with no window given sees every key.
    out = {"window": (case.window or NO_WINDOW) if k.window is Window.EXACT else None}
    if k.softcap is SoftCap.TANH:
        out["softcap"] = case.softcap
    if k.mode is Mode.PREFILL:
        out["full"] = k.mask is Mask.FULL
    return out


def shadow_args(k: Kernel, case: Case) -> dict:
    """The format's own scalar arguments: shadow rows in use, per-tensor scales."""
    out = {"sink": case.sink, "win": case.win} if k.pair.shadows else {}
    given = {"k_scale": case.k_scale, "v_scale": case.v_scale}
    out.update({name: given[name] for name in k.pair.scale_scalars()})
    return out


def sink_logits(g, case: Case, heads: int) -> np.ndarray:
    """Learned sink logits of every q head: random when the case turns sinks on, else
    -inf (a sink that changes no bit)."""
    if case.sinks:
        return (g.standard_normal((heads,)).astype(np.float32) * 2).astype(np.float32)
    return np.full(heads, -np.inf, np.float32)
