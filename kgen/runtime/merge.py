"""The engine's MergeAttnStates as one call: ``merge_attn_states``.

Two attention results over disjoint key sets (a cached prefix and the new suffix of a
chunked prefill, two context chunks of an MLA prefill) merge by their log-sum-exps
(../shared/docs/engine-ops.md): per (token, head), m = max(p_lse, s_lse),
ps = exp(p_lse - m), ss = exp(s_lse - m), out = prefix * ps / (ps + ss) +
suffix * ss / (ps + ss), out_lse = m + log(ps + ss), in f32. A +inf LSE counts as -inf;
where both are -inf the prefix output and -inf are written. Tokens at index
>= prefill_tokens_with_context take the suffix verbatim (< 0: every token merges).

The outputs are float32, bf16 (uint16 bit patterns) or float16 (kgen.ir.axes.IoDtype:
in_dtype for the two merged, out_dtype for the merged one), the LSEs float32, the math
f32 whatever the element types. The kernel is chosen by its axes (op =
merge_attn_states; lse = write when an output_lse is given, lse = none for
``output_lse=None``; in_dtype from prefix_output, out_dtype from output), and its
launcher checks every
contract before the GPU is touched (kgen.runtime.bind: dtypes, contiguity, the
[T, H, Dv] outputs alike, the LSEs [H, T]).
"""

from __future__ import annotations

from kgen.ir.axes import IoDtype, Lse, Op
from kgen.ir.params import PARAMS
from kgen.runtime.convention import public
from kgen.runtime.options import io_dtype
from kgen.runtime.select import Role, find

_CHOSEN: dict[tuple, object] = {}  # (lse, in_dtype, out_dtype, variant) -> launcher
WHO = "merge_attn_states"


def role(lse: Lse, in_dtype: IoDtype = IoDtype.F32, out_dtype: IoDtype = IoDtype.F32) -> Role:
    """What a merge needs a kernel for: writing the merged LSE too, or not, and the
    element types of the outputs merged (in_dtype) and of the merged one (out_dtype)."""
    return Role(Op.MERGE_ATTN_STATES, needs=(("in_dtype", in_dtype.value), ("lse", lse.value),
                                             ("out_dtype", out_dtype.value)))


def launcher(lse: Lse, variant: str | None = None, in_dtype: IoDtype = IoDtype.F32,
             out_dtype: IoDtype = IoDtype.F32):
    """The generated launcher that serves a merge writing the LSE (``Lse.WRITE``) or not,
    of those element types (``variant``: a kernel name, checked to serve it); chosen once,
    then kept."""
    key = (lse, in_dtype, out_dtype, variant)
    fn = _CHOSEN.get(key)
    if fn is None:
        fn = _CHOSEN[key] = find(role(lse, in_dtype, out_dtype), 1, 1, variant)[1]
    return fn


@public(WHO, arrays=("output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse",
                     "output_lse"))
def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                      output_lse=None,
                      prefill_tokens_with_context: int =
                      PARAMS["prefill_tokens_with_context"].default,
                      *, stream=None, variant: str | None = None):
    """Merge ``prefix`` and ``suffix`` attention results into ``output`` (and, unless it
    is None, their merged LSE into ``output_lse``), in vLLM's argument order.

    output, prefix_output, suffix_output: ``[T, H, Dv]`` float32, bfloat16 or float16
    (prefix and suffix of one type, output of its own); output_lse, prefix_lse,
    suffix_lse: ``[H, T]`` float32 (vLLM's and the engine's layout); C-contiguous GPU
    arrays of any library (kgen.runtime.convention), on the caller's stream. Returns
    the bound kgen.runtime.Launch; a contract the arguments break raises
    kgen.runtime.ContractError before any launch.
    """
    lse = Lse.NONE if output_lse is None else Lse.WRITE
    fn = launcher(lse, variant, io_dtype("prefix_output", prefix_output, WHO),
                  io_dtype("output", output, WHO))
    outs = (output,) if lse is Lse.NONE else (output, output_lse)
    return fn(*outs, prefix_output, prefix_lse, suffix_output, suffix_lse,
              prefill_tokens_with_context=prefill_tokens_with_context, stream=stream)
