"""The engine's MergeAttnStates as one call: ``merge_attn_states``.

Two attention results over disjoint key sets (a cached prefix and the new suffix of a
chunked prefill, two context chunks of an MLA prefill) merge by their log-sum-exps
(../shared/docs/engine-ops.md): per (token, head), m = max(p_lse, s_lse),
ps = exp(p_lse - m), ss = exp(s_lse - m), out = prefix * ps / (ps + ss) +
suffix * ss / (ps + ss), out_lse = m + log(ps + ss), in f32. A +inf LSE counts as -inf;
where both are -inf the prefix output and -inf are written. Tokens at index
>= prefill_tokens_with_context take the suffix verbatim (< 0: every token merges).

The kernel is chosen by its axes (op = merge_attn_states; lse = write when an
output_lse is given, lse = none for ``output_lse=None``), and its launcher checks every
contract before the GPU is touched (kgen.runtime.bind: dtypes, contiguity, the
[T, H, Dv] outputs alike, the LSEs [H, T]).
"""

from __future__ import annotations

from kgen.ir.axes import Lse, Op
from kgen.ir.params import PARAMS
from kgen.runtime.select import Role, find

_CHOSEN: dict[tuple[Lse, str | None], object] = {}  # (lse, variant) -> launcher


def role(lse: Lse) -> Role:
    """What a merge needs a kernel for: writing the merged LSE too, or not."""
    return Role(Op.MERGE_ATTN_STATES, needs=(("lse", lse.value),))


def launcher(lse: Lse, variant: str | None = None):
    """The generated launcher that serves a merge writing the LSE (``Lse.WRITE``) or not
    (``variant``: a kernel name, checked to serve it); chosen once, then kept."""
    key = (lse, variant)
    fn = _CHOSEN.get(key)
    if fn is None:
        fn = _CHOSEN[key] = find(role(lse), 1, 1, variant)[1]
    return fn


def merge_attn_states(output, output_lse, prefix_output, prefix_lse, suffix_output,
                      suffix_lse,
                      prefill_tokens_with_context: int =
                      PARAMS["prefill_tokens_with_context"].default,
                      *, stream=None, variant: str | None = None):
    """Merge ``prefix`` and ``suffix`` attention results into ``output`` (and, unless it
    is None, their merged LSE into ``output_lse``), the engine's argument order.

    output, prefix_output, suffix_output: ``[T, H, Dv]`` float32; output_lse,
    prefix_lse, suffix_lse: ``[H, T]`` float32 (the engine's layout); all C-contiguous
    CuPy arrays on the current device. Returns the bound kgen.runtime.Launch; a
    contract the arguments break raises kgen.runtime.ContractError before any launch.
    """
    lse = Lse.NONE if output_lse is None else Lse.WRITE
    fn = launcher(lse, variant)
    outs = (output,) if lse is Lse.NONE else (output, output_lse)
    return fn(*outs, prefix_output, prefix_lse, suffix_output, suffix_lse,
              prefill_tokens_with_context=prefill_tokens_with_context, stream=stream)
