"""Calling generated kernels from Python.

Every public call here (and every cache object's method) follows one convention,
written once in kgen.runtime.convention: arrays of any GPU library (CuPy, torch,
__cuda_array_interface__, DLPack), the caller's stream (torch's current one where
torch tensors come in), results in the caller's library, and for the caches the
model's dtypes (float32, float16, bfloat16). ``kgen`` re-exports all of it.

``bind`` turns a kernel's spec and the caller's arrays into a ``Launch`` (grid,
block, dynamic shared memory, argument tuple) after checking every contract
the kernel relies on; it touches no GPU, so contract checks run anywhere.
``launch`` then hands the Launch to CuPy. The generated modules
(``kgen_kernels``, from generated/) wrap these as one function per kernel.
``merge_attn_states`` is the engine's MergeAttnStates as one call (kgen.runtime.merge);
``mask_empty_context_lse`` sets the context LSE of requests with no context to -inf
before it (kgen.runtime.mask);
``concat_and_cache_mla``, ``gather_mla_cache``, ``mla_decode_attention``,
``mla_prefill_attention`` and ``MLACache``
are the engine's multi-head latent attention ops (kgen.runtime.mla).
``dflash_block_attention`` and ``dflash_paged_block_attention`` its DFlash block
attention (kgen.runtime.dflash); ``attention_dense_fast`` and ``attention_dense_flash``
its AttentionDenseFast / AttentionDenseFlash (kgen.runtime.attention_dense).
"""

from kgen.runtime.attention_dense import attention_dense_fast, attention_dense_flash
from kgen.runtime.bind import Launch, bind
from kgen.runtime.contracts import ContractError
from kgen.runtime.dflash import dflash_block_attention, dflash_paged_block_attention
from kgen.runtime.engine import PagedMetadata, paged_attention, reshape_and_cache
from kgen.runtime.kv import KVCache, SlotKVCache
from kgen.runtime.mask import mask_empty_context_lse
from kgen.runtime.merge import merge_attn_states
from kgen.runtime.mla import (
    MLACache,
    concat_and_cache_mla,
    gather_mla_cache,
    mla_decode_attention,
    mla_prefill_attention,
)
from kgen.runtime.paged import DecodeMetadata, PagedKVCache
from kgen.runtime.plan import DecodePlan, decode_plan

__all__ = ["ContractError", "DecodeMetadata", "DecodePlan", "KVCache", "Launch", "MLACache",
           "PagedKVCache", "PagedMetadata", "SlotKVCache", "attention_dense_fast",
           "attention_dense_flash", "bind", "concat_and_cache_mla",
           "decode_plan", "dflash_block_attention", "dflash_paged_block_attention",
           "gather_mla_cache", "mask_empty_context_lse", "merge_attn_states",
           "mla_decode_attention", "mla_prefill_attention", "paged_attention",
           "reshape_and_cache"]
