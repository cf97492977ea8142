"""The scalar parameters a caller may leave out of a launch, each once: its
default (what the generated launcher and ``bind`` take when it is not given),
the range ``bind`` and the cache objects check, and its neutral value, the one
meaning the plain path (the option off: the kernel's result is bit for bit that
of a kernel without the option).

The launchers' signatures (``kgen.ir.pyapi``), the contracts
(``kgen.runtime.bind``), the cache objects' options (``kgen.runtime.options``)
and the generated tests' arguments (``kgen.testing``) all ask this table.
"""

from __future__ import annotations

from dataclasses import dataclass

from kgen.ir.target import TARGET

INT_MAX = 2**31 - 1  # the largest C int the kernels take
INT_MIN = -(2**31)   # the least


@dataclass(frozen=True)
class Param:
    name: str
    kind: type              # int, or float (received as a float32)
    default: int | float | None  # None: scale, then 1 / sqrt(head_dim)
    neutral: int | float | None
    lo: int = 0             # the least value (floats: > lo where positive, else >= lo)
    hi: int | None = None   # ints: the most value
    positive: bool = False  # floats: strictly above lo
    doc: str = ""


def _table(*params: Param) -> dict[str, Param]:
    return {p.name: p for p in params}


PARAMS = _table(
    Param("attn_sink", int, 0, 0, 0, INT_MAX, doc="the first keys every query sees "
          "(tile-granular)"),
    Param("attn_win", int, 0, 0, 0, INT_MAX, doc="the recent keys a query sees "
          "(tile-granular); 0: no window"),
    Param("scale", float, None, None, 0, positive=True, doc="the score scale; None: "
          "1 / sqrt(head_dim)"),
    Param("win_left", int, INT_MAX, INT_MAX, 0, INT_MAX, doc="key-exact window: keys at "
          "most this far before the query; INT_MAX: no window"),
    Param("win_right", int, INT_MAX, INT_MAX, 0, INT_MAX, doc="key-exact window: keys at "
          "most this far after the query; INT_MAX: no window"),
    Param("softcap", float, 0.0, 0.0, 0, doc="tanh soft-cap of the scores; 0: off"),
    Param("k_scale", float, 1.0, 1.0, 0, positive=True, doc="per-tensor K scale (rows "
          "hold k / k_scale)"),
    Param("v_scale", float, 1.0, 1.0, 0, positive=True, doc="per-tensor V scale (rows "
          "hold v / v_scale)"),
    Param("prefill_tokens_with_context", int, -1, -1, INT_MIN, INT_MAX, doc="merge: tokens "
          "at this index and past it take the suffix verbatim; < 0: every token merges"),
    Param("block_causal", int, 0, 0, 0, 1, doc="dflash and dense_attention (the engine's "
          "causal): 1: query i of a block sees keys j <= i (and the sliding window); 0: "
          "every key of its block (bidirectional)"),
    Param("sliding_window", int, 0, 0, INT_MIN, INT_MAX, doc="dflash, causal: keys "
          "j >= i - (window - 1) too; <= 0: plain causal"),
)

# Parameters of the entry points that chain launches (kgen.runtime.mla), not of any
# launcher: they decide the launches' shapes.
ENTRY_PARAMS = _table(
    Param("num_kv_splits", int, 0, 1, 0, TARGET.grid_yz_max, doc="MLA decode: key splits "
          "per request (the split grid's y); 0: the default (kgen.ir.geometry."
          "mla_default_splits), 1: one split (batch-invariant)"),
)

NO_WINDOW = (PARAMS["win_left"].neutral, PARAMS["win_right"].neutral)  # (left, right)
