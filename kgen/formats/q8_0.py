"""KV format q8_0: llama.cpp's Q8_0 blocks, bit for bit.

A row of head_dim values is head_dim/32 blocks of 34 bytes: an fp16 scale d
(little-endian) then 32 int8 codes; code c decodes to c * d. Quantization is
llama.cpp's: amax = max |x| over the block, d = amax / 127, id = 1/d (0 when
d == 0), c = roundf(x * id) (half away from zero), all in float32, the stored
scale __float2half(d). The device converts with (int) (NaN -> 0, saturating)
and clamps to [-128, 127], which this model mirrors.

No fp16 shadows: a q8_0 element's error (at most half a step of amax/127) is
small against attention's tolerance, and shadows would cost a second write per
append and two branches per key read.
"""

from __future__ import annotations

import numpy as np

from kgen.formats.base import KvFormat

BLOCK = 32
BLOCK_BYTES = 34


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf on float32 values (exact in float64: |v| + 0.5 needs no rounding)."""
    v = v.astype(np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(v >= 0, np.floor(v + 0.5), -np.floor(-v + 0.5))


def _device_codes(v: np.ndarray) -> np.ndarray:
    """``clamp((int)roundf(v), -128, 127)``: cvt.rzi.s32 gives 0 for NaN, saturates."""
    r = _roundf(v)
    r = np.where(np.isnan(r), 0.0, np.clip(r, -(2**31), 2**31 - 1))
    return np.clip(r, -128, 127).astype(np.int8)


def quantize_rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    hd = x.shape[-1]
    if hd <= 0 or hd % BLOCK:
        raise ValueError(f"head_dim must be a positive multiple of {BLOCK}, got {hd}")
    lead, nb = x.shape[:-1], hd // BLOCK
    blocks = x.reshape(lead + (nb, BLOCK))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        amax = np.fmax.reduce(np.abs(blocks), axis=-1, initial=np.float32(0.0))
        d = (amax.astype(np.float32) / np.float32(127.0)).astype(np.float32)
        nz = d != 0
        inv = np.where(nz, np.float32(1.0) / np.where(nz, d, np.float32(1.0)), 0.0)
        products = blocks * inv.astype(np.float32)[..., None]
        bits = d.astype(np.float16).view(np.uint16)
    out = np.empty(lead + (nb, BLOCK_BYTES), dtype=np.uint8)
    out[..., 0] = bits & 0xFF
    out[..., 1] = bits >> 8
    out[..., 2:] = _device_codes(products).view(np.uint8)
    return out.reshape(lead + (nb * BLOCK_BYTES,))


def dequantize_rows(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.uint8)
    if rows.shape[-1] % BLOCK_BYTES:
        raise ValueError(f"a q8_0 row is whole blocks of {BLOCK_BYTES} bytes")
    lead, nb = rows.shape[:-1], rows.shape[-1] // BLOCK_BYTES
    blk = rows.reshape(lead + (nb, BLOCK_BYTES))
    bits = blk[..., 0].astype(np.uint16) | (blk[..., 1].astype(np.uint16) << 8)
    d = np.ascontiguousarray(bits).view(np.float16).astype(np.float32)
    codes = np.ascontiguousarray(blk[..., 2:]).view(np.int8).astype(np.float32)
    with np.errstate(invalid="ignore"):
        return (codes * d[..., None]).reshape(lead + (nb * BLOCK,))


def block_fp16_scales(rows: np.ndarray) -> np.ndarray:
    """The binary16 scale of every block of rows, as float64 ``[..., blocks]``."""
    blk = np.asarray(rows, dtype=np.uint8)
    blk = blk.reshape(blk.shape[:-1] + (-1, BLOCK_BYTES))
    bits = blk[..., 0].astype(np.uint16) | (blk[..., 1].astype(np.uint16) << 8)
    return np.ascontiguousarray(bits).view(np.float16).astype(np.float64)


class _Q8_0(KvFormat):
    def quantize_rows(self, x: np.ndarray, scale: float = 1.0) -> np.ndarray:
        return quantize_rows(x)

    def round_trip_bound(self, x, rows):
        """Half a step (amax / 254) of rounding, plus up to 127 times the fp16 scale's
        error (amax / 254 alone does not bound it when d is not a binary16 value)."""
        x = np.asarray(x, dtype=np.float64)
        blocks = x.reshape(x.shape[:-1] + (-1, BLOCK))
        amax = np.abs(blocks).max(-1, keepdims=True)
        d32 = (amax.astype(np.float32) / np.float32(127)).astype(np.float64)
        d16 = block_fp16_scales(rows)[..., None]
        bound = amax / 254 * (1 + 1e-5) + 127 * np.abs(d32 - d16)
        return x, np.broadcast_to(bound, blocks.shape).reshape(x.shape)

    def dequantize_rows(self, rows: np.ndarray, scale: float = 1.0) -> np.ndarray:
        return dequantize_rows(rows)


FORMAT = _Q8_0(name="q8_0", doc="Q8_0 blocks (fp16 scale + 32 int8 codes per 32 values), "
               "as llama.cpp stores them", ctype="unsigned char", dtype="uint8",
               block=BLOCK, block_width=BLOCK_BYTES, append_staging=True, fp16=True,
               exact_elements=False, block_align=2)
