"""Chunked prefill's helper before merge_attn_states, as one call:
``mask_empty_context_lse``.

A request whose context is empty contributes nothing to the merge of the context
attention's partial result with the new tokens' one, so its tokens' context LSE is set
to -inf (merge_attn_states then takes the new tokens' result there). The kernel is the
op's (kgen.ops.mask_empty_context_lse: op = mask_empty_context_lse, no axes); its
launcher checks every contract before the GPU is touched, reading the index arrays back
unless ``validate`` says not (kgen.runtime.convention.read_back).
"""

from __future__ import annotations

from kgen.ops import get
from kgen.runtime.convention import public, read_back
from kgen.runtime.select import find

WHO = "mask_empty_context_lse"
_CHOSEN: dict[str, object] = {}  # WHO -> its launcher


def launcher():
    """The generated launcher of the op (chosen once, then kept)."""
    fn = _CHOSEN.get(WHO)
    if fn is None:
        fn = _CHOSEN[WHO] = find(get(WHO).role(), 1, 1)[1]
    return fn


@public(WHO, arrays=("lse", "cu_seqlens_q", "context_lens"))
def mask_empty_context_lse(lse, cu_seqlens_q, context_lens, *, validate: bool | None = None,
                           stream=None):
    """For every request r with ``context_lens[r] == 0``, set ``lse[h, t] = -inf`` for
    every head h and token t in ``[cu_seqlens_q[r], cu_seqlens_q[r + 1])``; every other
    element is left as it was, bit for bit.

    lse: ``[H, T]`` float32 (merge_attn_states' LSE layout), written in place and
    returned; cu_seqlens_q: ``[B + 1]`` int32 (0, non-decreasing, T last); context_lens:
    ``[B]`` int32, >= 0. C-contiguous GPU arrays of any library
    (kgen.runtime.convention), on the caller's stream; a contract the arguments break
    raises kgen.runtime.ContractError before any launch.
    """
    launcher()(lse, cu_seqlens_q, context_lens,
               validate_pos=read_back(validate, stream, WHO), stream=stream)
    return lse
