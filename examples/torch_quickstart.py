"""kgen from PyTorch: a quantized KV cache fed bfloat16 tensors on torch's stream.

    python examples/torch_quickstart.py     # on a GPU, with kgen and torch installed
"""

import torch

import kgen

cache = kgen.KVCache(n_head_kv=8, head_dim=128, max_seq=4096, kv="q8_0")
q = torch.randn(512, 32, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(512, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
out = cache.prefill(q, k, v, pos0=0)               # torch.bfloat16 [512, 32, 128]
q1 = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
k1, v1 = (torch.randn(1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
o = cache.decode(q1, k1, v1, pos=512)              # token-major [1, 32, 128]
print(out.dtype, tuple(out.shape), tuple(o.shape), bool(torch.isfinite(o).all()))
