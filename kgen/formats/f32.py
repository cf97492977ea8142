"""KV format f32: cache rows are head_dim floats, read back exactly."""

from __future__ import annotations

import numpy as np

from kgen.formats.base import KvFormat


class _F32(KvFormat):
    def quantize_rows(self, x: np.ndarray, scale: float = 1.0) -> np.ndarray:
        return np.asarray(x, dtype=np.float32).copy()

    def round_trip_bound(self, x, rows):
        x = np.asarray(x, dtype=np.float64)
        return x, np.zeros_like(x)  # exact, bit for bit

    def dequantize_rows(self, rows: np.ndarray, scale: float = 1.0) -> np.ndarray:
        return np.asarray(rows, dtype=np.float32)


FORMAT = _F32(name="f32", doc="float rows", ctype="float", dtype="float32")
