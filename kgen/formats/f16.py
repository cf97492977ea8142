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

    def round_trip_bound(self, x, rows):
        """Round to nearest: half an ulp (2^-11 relative for normals, 2^-25 below);
        overflow to inf past the half-way point above 65504."""
        x = np.asarray(x, dtype=np.float64)
        ax = np.abs(x)
        target = np.where(ax >= 65520, np.copysign(np.inf, x), x)
        return target, np.maximum(ax * 2.0**-11, 2.0**-25)

    def dequantize_rows(self, rows: np.ndarray, scale: float = 1.0) -> np.ndarray:
        return np.asarray(rows, dtype=np.float16).astype(np.float32)  # exact


FORMAT = _F16(name="f16", doc="half rows, f32 math", ctype="__half", dtype="float16",
              fp16=True, exact_elements=False)
