"""NumPy reference for the generated attention kernels, for any KV format.

* :mod:`.cache` -- the append kernels on NumPy arrays (through each format's
  quantize model, ``kgen.formats``), and which rows (body or fp16 shadow) a
  flash kernel reads for a query.
* :mod:`.attention` -- prefill, decode split partials and combine, in float64
  over the exact key set the kernels attend (whole tiles of the kernel's
  ``tile_keys``).
* :mod:`.dense` -- the engine's dense Attention over one sequence (AttentionDenseFast,
  AttentionDenseFlash), from the doc's definition.
* :mod:`.dflash` -- the engine's DFlash block attention (dense and paged), from
  the doc's definition.
* :mod:`.merge` -- the engine's MergeAttnStates (two partial results merged by
  their LSEs), from the doc's formulas.
* :mod:`.mla` -- the engine's multi-head latent attention ops (the latent cache's
  store and gather, the decode), from the doc's definitions.

GPU tests compare the kernels against these functions: bytes exactly for the
cache, float64 values within a tolerance for attention.
"""

from .attention import (
    DOT_LANES,
    MAX_GROUPS,
    TILE_KEYS,
    attended_keys,
    combine,
    decode_attention,
    decode_attention_slots,
    decode_partials,
    decode_partials_slots,
    decode_plan,
    exact_keys,
    key_mask,
    keys_scored_per_tile,
    nominal_window_keys,
    prefill_attention,
    prefill_attention_cache,
    prefill_attention_rows,
    qz_split,
    soft_cap,
    split_bounds,
    tile_in_window,
)
from .cache import (
    SRC_BODY,
    SRC_SINK,
    SRC_WINDOW,
    HostCache,
    append,
    append_dev,
    append_rows,
    append_slots,
    fill,
    prefill_live_floor,
    read_kv_rows,
    shadow_source,
)
from .dense import attention_dense
from .dflash import dflash_block_attention, dflash_paged_block_attention
from .merge import merge_attn_states
from .mla import (
    concat_and_cache_mla,
    gather_mla_cache,
    mla_decode,
    mla_decode_partials,
    mla_merge,
    mla_prefill,
)
from .paged import PagedCache, dense, slots_of

__all__ = [
    "DOT_LANES", "MAX_GROUPS", "SRC_BODY", "SRC_SINK", "SRC_WINDOW", "TILE_KEYS", "HostCache",
    "PagedCache", "dense", "slots_of",
    "append", "append_dev", "append_rows", "append_slots", "attended_keys", "combine",
    "decode_attention", "decode_attention_slots", "decode_partials", "decode_partials_slots",
    "attention_dense", "dflash_block_attention", "dflash_paged_block_attention",
    "decode_plan", "exact_keys", "fill", "key_mask", "keys_scored_per_tile",
    "merge_attn_states", "concat_and_cache_mla", "gather_mla_cache", "mla_decode",
    "mla_decode_partials", "mla_merge", "mla_prefill",
    "nominal_window_keys", "prefill_attention", "soft_cap",
    "prefill_attention_cache", "prefill_attention_rows", "prefill_live_floor", "qz_split",
    "read_kv_rows", "shadow_source", "split_bounds", "tile_in_window",
]
