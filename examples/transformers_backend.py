"""kgen as a transformers attention backend: a Llama model loaded with
``attn_implementation="kgen"``.

    python examples/transformers_backend.py  # on a GPU, with kgen, torch and transformers

``register()`` adds kgen to transformers' AttentionInterface. Each attention layer then
keeps its own kgen pages, as an inference engine does. ``torch.ops.kgen.reshape_and_cache``
stores a step's keys and values, and ``torch.ops.kgen.paged_attention`` attends: a varlen
prefill of the prompts, then one decode step a token. The ops are kgen.torch's, so
torch.compile sees them. A tiny Llama, initialised at random from a seed (nothing is
downloaded), generates greedily in float32, once with kgen and once with transformers'
own eager attention, and ``run`` asserts that the tokens are equal.

The backend serves what this example generates: batches without padding (every prompt of
one length, no attention mask), causal attention, no sliding window or softcap.
"""

from __future__ import annotations

import torch

import kgen.torch  # noqa: F401  (registers torch.ops.kgen)

LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 4, 2, 64, 512
BATCH, PROMPT, NEW_TOKENS = 2, 19, 12
BLOCK = 16  # positions a page holds


class Pages:
    """One layer's kgen pages ``[blocks, BLOCK, kv_heads, head_dim]`` for K and for V, in
    the model's dtype, with each sequence of the batch owning a fixed run of blocks (its
    row of the block table), for up to ``capacity`` tokens a sequence."""

    def __init__(self, batch: int, capacity: int, kv_heads: int, head_dim: int, like):
        per_seq = -(-capacity // BLOCK)
        self.batch, self.capacity = batch, per_seq * BLOCK
        shape = (batch * per_seq, BLOCK, kv_heads, head_dim)
        self.key = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.value = torch.zeros_like(self.key)
        self.block_table = torch.arange(batch * per_seq, dtype=torch.int32,
                                        device=like.device).reshape(batch, per_seq)

    def step(self, rows: int, past: int) -> tuple:
        """(query_start_loc, seq_lens, block_table, slot_mapping) of a step that adds
        ``rows`` tokens to every sequence after its ``past`` ones."""
        if past + rows > self.capacity:
            raise ValueError(f"{past + rows} tokens exceed the pages' {self.capacity}")
        dev = self.key.device
        seqs = torch.arange(self.batch, dtype=torch.int32, device=dev)
        qsl = torch.arange(self.batch + 1, dtype=torch.int32, device=dev) * rows
        lens = torch.full((self.batch,), past + rows, dtype=torch.int32, device=dev)
        pos = torch.arange(past, past + rows, dtype=torch.int32, device=dev)
        slots = (seqs[:, None] * self.capacity + pos[None, :]).reshape(-1)  # blocks in a run
        return qsl, lens, self.block_table, slots


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              **kwargs):
    """transformers' attention interface over kgen: query ``[B, H, S, D]``, key and value
    ``[B, Hkv, past + S, D]`` (transformers' cache has appended this step's rows, the
    last S); returns ``([B, S, H, D], None)``. The layer's pages (kept on the module)
    take the step's S new rows of every sequence, and the queries attend over them."""
    if attention_mask is not None or dropout:
        raise ValueError("the kgen backend serves unpadded batches without dropout")
    B, H, S, D = query.shape
    Hk, L = key.shape[1], key.shape[2]
    past = L - S
    pages = getattr(module, "kgen_pages", None)
    if pages is None or pages.batch != B or past == 0:  # a new batch of sequences
        pages = module.kgen_pages = Pages(B, module.config.max_position_embeddings, Hk, D,
                                          query)
    qsl, lens, table, slots = pages.step(S, past)
    # token-major rows [B * S, heads, D], as kgen takes them
    q = query.transpose(1, 2).reshape(B * S, H, D)
    k_new = key[:, :, past:].transpose(1, 2).reshape(B * S, Hk, D)
    v_new = value[:, :, past:].transpose(1, 2).reshape(B * S, Hk, D)
    torch.ops.kgen.reshape_and_cache(k_new, v_new, pages.key, pages.value, slots)
    out = torch.ops.kgen.paged_attention(q, pages.key, pages.value, qsl, lens, table, slots,
                                         S, L, scale=scaling)
    return out.view(B, S, H, D), None


def register() -> None:
    """kgen in transformers' AttentionInterface, as ``attn_implementation="kgen"``."""
    from transformers import AttentionInterface

    AttentionInterface.register("kgen", attention)


def config():
    """The tiny Llama's config: GQA (HEADS q heads over KV_HEADS), head_dim HEAD_DIM, no
    end-of-sequence token; its weights drawn wide enough (initializer_range) that a
    greedy step's best two logits stand apart (by 0.037 or more at seed 0)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=512,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                       max_position_embeddings=64, initializer_range=0.1, bos_token_id=None,
                       eos_token_id=None, pad_token_id=0)


def models(seed: int = 0, device: str = "cuda"):
    """(kgen's model, eager's model): one random float32 Llama (from ``seed``) loaded with
    each attention implementation, the same weights in both."""
    from transformers import AutoModelForCausalLM

    register()
    torch.manual_seed(seed)
    eager = AutoModelForCausalLM.from_config(config(), attn_implementation="eager")
    mine = AutoModelForCausalLM.from_config(config(), attn_implementation="kgen")
    mine.load_state_dict(eager.state_dict())
    return mine.to(device).eval(), eager.to(device).eval()


@torch.no_grad()
def greedy(model, prompt, new_tokens: int):
    """``new_tokens`` greedy tokens after ``prompt`` [B, S] (transformers' generate: a
    prefill, then a decode step a token through its cache), and each step's logits."""
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, prompt.shape[1]:], torch.stack(out.logits, 1)


def run(seed: int = 0, device: str = "cuda"):
    """Greedy generation with kgen and with eager attention from one seeded model and
    prompt: the tokens must be equal (and the logits close). Returns kgen's tokens and
    the largest logit difference."""
    mine, eager = models(seed, device)
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=g).to(device)
    tokens, logits = greedy(mine, prompt, NEW_TOKENS)
    want, want_logits = greedy(eager, prompt, NEW_TOKENS)
    diff = float((logits - want_logits).abs().max())
    assert torch.equal(tokens, want), f"kgen {tokens.tolist()} != eager {want.tolist()}"
    assert diff < 1e-3, f"logits differ by {diff}"
    return tokens, diff


if __name__ == "__main__":
    tokens, diff = run()
    print(f"{tuple(tokens.shape)} tokens equal to eager attention's, logits within {diff:.2e}:",
          bool(torch.isfinite(torch.tensor(diff))))
