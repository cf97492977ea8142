"""What a case gives a kernel beyond its arrays, as the launcher and as the NumPy
reference take it: the attention options the kernel has, the format's own
scalars, and the learned sink logits."""

from __future__ import annotations

import numpy as np

from kgen.ir.axes import Mask, Mode, SoftCap, Window
from kgen.ir.geometry import key_partials
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


# The key splits a generated test runs a split prefill (key_split = partials) over: more
# than one, and not a divisor of the tests' key tiles, so shares differ and some are empty.
PREFILL_TEST_SPLITS = 3


def prefill_outputs(k: Kernel, rows: int, n_head: int, hd: int, alloc) -> dict:
    """A prefill's output arrays from ``alloc(shape, dtype)``: out [rows][n_head][hd],
    or, split over keys, the (m, l, acc) partials of rows * n_head combine heads x
    PREFILL_TEST_SPLITS (with n_splits)."""
    if not key_partials(k):
        return {"out": alloc((rows, n_head, hd), np.float32)}
    heads = rows * n_head * PREFILL_TEST_SPLITS
    return {"m_out": alloc((heads,), np.float32), "l_out": alloc((heads,), np.float32),
            "acc_out": alloc((heads * hd,), np.float32), "n_splits": PREFILL_TEST_SPLITS}


def split_outputs(parts: dict) -> tuple[list, dict]:
    """``prefill_outputs``' values as a launcher takes them: the output arrays in order
    (positional), and n_splits where the kernel takes it (keyword)."""
    arrays = [v for name, v in parts.items() if name != "n_splits"]
    return arrays, ({"n_splits": parts["n_splits"]} if "n_splits" in parts else {})


def combined(k: Kernel, parts: dict, rows: int, n_head: int, hd: int) -> np.ndarray:
    """A prefill's output from what ``prefill_outputs`` gave the launch (device arrays,
    filled): out itself, or the partials folded by the float64 combine."""
    from kgen import numpy_ref as ref

    if not key_partials(k):
        return parts["out"].get()
    S = parts["n_splits"]
    out = ref.combine(parts["m_out"].get(), parts["l_out"].get(), parts["acc_out"].get(), S)
    return out.reshape(rows, n_head, hd)
