"""KV format fp8_e4m3: one byte per element (e4m3fn: no infinities, NaN =
S.1111.111, largest finite 448), with per-tensor scales: rows hold x / k_scale
(x / v_scale), readers compute fp8_to_float(x) * k_scale. sm_37 has no fp8
hardware: both directions are integer code (templates/lib/fp8_e4m3.cuh.j2),
mirrored here bit for bit. Encoding rounds to nearest even and saturates to
+-448 (NaN stays NaN), as the engine's store does."""

from __future__ import annotations

import numpy as np

from kgen.formats.base import KvFormat

MAX_FINITE = 448.0


def encode(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn bytes: round to nearest even, saturate, NaN to 0x7f."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    sign = ((u >> 24) & 0x80).astype(np.uint8)
    a = np.abs(x)
    au = a.view(np.uint32).astype(np.int64)
    # normal range: 3 mantissa bits, round to nearest even on the dropped 20 bits
    e32 = (au >> 23) - 127
    m23 = au & 0x7FFFFF
    m3 = m23 >> 20
    rem = m23 & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((m3 & 1) == 1))
    m3 = m3 + up
    e32 = np.where(m3 == 8, e32 + 1, e32)
    m3 = np.where(m3 == 8, 0, m3)
    normal = ((e32 + 7) << 3) | m3
    small = np.where(a < np.float32(2.0**-6), a, np.float32(0.0))  # NaN compares False
    sub = np.rint(small * np.float32(512.0)).astype(np.int64)  # exact: a power of two
    code = np.where(a < np.float32(2.0**-6), sub, normal)
    code = np.where(a >= np.float32(MAX_FINITE), 0x7E, code)
    code = np.where(np.isnan(x), 0x7F, code)
    return (code.astype(np.uint8) | sign).astype(np.uint8)


def decode(b: np.ndarray) -> np.ndarray:
    """e4m3fn bytes -> float32 (exact)."""
    b = np.asarray(b, dtype=np.uint8).astype(np.uint32)
    sign = (b & 0x80) << 24
    em = b & 0x7F
    normal = (sign | ((em + (120 << 3)) << 20)).astype(np.uint32).view(np.float32)
    sub = (em.astype(np.float32) * np.float32(2.0**-9))
    sub = np.where(sign != 0, -sub, sub).astype(np.float32)
    out = np.where(em < 8, sub, normal)
    return np.where(em == 0x7F, np.float32(np.nan), out).astype(np.float32)


class _Fp8E4M3(KvFormat):
    def quantize_rows(self, x: np.ndarray, scale: float = 1.0) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return encode(np.asarray(x, dtype=np.float32) / np.float32(scale))

    def round_trip_bound(self, x, rows):
        """Half a step of 3 mantissa bits (2^-4 relative) in the normal range, half of
        2^-9 below 2^-6, and saturation to +-448 beyond it."""
        x = np.asarray(x, dtype=np.float64)
        a = np.minimum(np.abs(x), 448)
        return np.clip(x, -448, 448), np.maximum(a * 2.0**-4, 2.0**-10) * (1 + 1e-6)

    def dequantize_rows(self, rows: np.ndarray, scale: float = 1.0) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):
            return (decode(rows) * np.float32(scale)).astype(np.float32)

    def poison(self) -> object:
        return 0x7F  # NaN


FORMAT = _Fp8E4M3(name="fp8_e4m3", doc="one e4m3fn byte per element, per-tensor k/v scales",
                  ctype="unsigned char", dtype="uint8", tensor_scales=True,
                  exact_elements=False)
