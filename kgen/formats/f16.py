"""KV format f16: cache rows are head_dim halves (round to nearest even on append,
overflow to inf, as __float2half does); the kernels widen them and compute in f32.
No fp16 shadows: the body already is fp16."""

from __future__ import annotations

import numpy as np

from kgen.formats.base import KvFormat


class _F16(KvFormat):
    def quantize_rows(self, x: np.ndarray, scale: float = 1.0) -> np.ndarray:
        with np.errstate(over="ignore"):
            return np.asarray(x, dtype=np.float32).astype(np.float16)

    def dequantize_rows(self, rows: np.ndarray, scale: float = 1.0) -> np.ndarray:
        return np.asarray(rows, dtype=np.float16).astype(np.float32)  # exact


FORMAT = _F16(name="f16", doc="half rows, f32 math", ctype="__half", dtype="float16",
              fp16=True, exact_elements=False)
