"""KV format bf16: cache rows are head_dim bfloat16 values, the top 16 bits of a
float32 (the caches llama.cpp and FlashInfer serve); the kernels widen them and
compute in f32. sm_37 has no bf16 hardware: both directions are integer code
(templates/lib/bf16.cuh.j2), mirrored here bit for bit. Reading is exact
(the bits shifted up 16); appending rounds to nearest even, overflows to inf,
keeps inf, and keeps a NaN a quiet NaN (its sign and top payload, quiet bit set).
No fp16 shadows: the body already is 16-bit."""

from __future__ import annotations

import numpy as np

from kgen.formats.base import KvFormat

QUIET_NAN = 0x7FC0  # the canonical quiet NaN


def encode(x: np.ndarray, xp=np) -> np.ndarray:
    """float32 -> bf16 bits: round to nearest even; NaN stays a quiet NaN. ``xp``: the
    array module (NumPy, or CuPy for device arrays: the same arithmetic there)."""
    u = xp.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rne = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # carries into the exponent: up to inf
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return xp.where(nan, (u >> 16) | 0x0040, rne).astype(np.uint16)


def decode(b: np.ndarray, xp=np) -> np.ndarray:
    """bf16 bits -> float32 (exact: the bits are a float32's top half); ``xp`` as for
    encode."""
    return (xp.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class _Bf16(KvFormat):
    def quantize_rows(self, x: np.ndarray, scale: float = 1.0) -> np.ndarray:
        return encode(x)

    def dequantize_rows(self, rows: np.ndarray, scale: float = 1.0) -> np.ndarray:
        return decode(rows)

    def round_trip_bound(self, x, rows):
        """Round to nearest: half an ulp of 8 significant bits (2^-8 relative) for
        normals, 2^-134 for subnormals; overflow to inf only past the half-way point
        above the largest finite bf16."""
        x = np.asarray(x, dtype=np.float64)
        ax = np.abs(x)
        target = np.where(ax >= (2 - 2.0**-8) * 2.0**127, np.copysign(np.inf, x), x)
        return target, np.maximum(ax * 2.0**-8, 2.0**-134)

    def poison(self) -> object:
        return QUIET_NAN


FORMAT = _Bf16(name="bf16", doc="bfloat16 rows (the top half of a float), f32 math",
               ctype="unsigned short", dtype="uint16", exact_elements=False)
