"""KV format q4: Q4_0 rows plus fp16 sink/window shadows, and its NumPy model,
bit for bit as the GPU writes and reads it.

A row of ``head_dim`` float32 values is ``head_dim // 32`` blocks of 18 bytes:
two bytes of binary16 scale ``d`` (little-endian) then 16 code bytes, where
code byte ``j`` carries element ``j`` in its low nibble and element ``j + 16``
in its high nibble. Code ``c`` decodes to ``(c - 8) * d``.

Quantization mirrors ``fc_kvq4_quant_block`` and dequantization
``fc_kvq4_dequant_elem`` / ``fc_kvq4_dequant_lane_chunk`` (all three agree).
Every step is done in float32 (or binary16 for the stored scale) exactly as the
device does it, so the bytes match and no float64 appears here. Subnormals are
kept, as in an nvcc build with default flags (checked bit for bit on an H200).
Blocks whose scale ``d`` is a float32 subnormal (``amax`` below about 1e-37)
depend on that: a CuPy ``RawModule(code=...)`` build of the same quantizer gave
other codes for them, so build with nvcc and no ``-ftz=true`` / fast math.
"""

from __future__ import annotations

import numpy as np

from kgen.formats.base import KvFormat

BLOCK = 32
"""Elements per Q4_0 block."""

BLOCK_BYTES = 18
"""Bytes per Q4_0 block: 2 scale bytes + 16 code bytes."""

_HALF_BLOCK = BLOCK // 2
_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1


def _check_head_dim(head_dim: int) -> None:
    if head_dim <= 0 or head_dim % BLOCK:
        raise ValueError(f"head_dim must be a positive multiple of {BLOCK}, got {head_dim}")


def row_bytes(head_dim: int) -> int:
    """Bytes in one Q4_0 row of ``head_dim`` elements (mirrors ``fc_kvq4_row_bytes``)."""
    _check_head_dim(head_dim)
    return (head_dim // BLOCK) * BLOCK_BYTES


def head_dim_of(n_row_bytes: int) -> int:
    """Inverse of :func:`row_bytes`."""
    if n_row_bytes <= 0 or n_row_bytes % BLOCK_BYTES:
        raise ValueError(f"row length must be a positive multiple of {BLOCK_BYTES} bytes")
    return (n_row_bytes // BLOCK_BYTES) * BLOCK


def block_scales(x: np.ndarray) -> np.ndarray:
    """Float32 scale ``d`` of every 32-element block of ``x[..., head_dim]``.

    Mirrors the first half of ``fc_kvq4_quant_block``: ``amax`` is a serial
    ``fmaxf`` fold of ``fabsf`` starting from ``0.0f``. ``fmaxf`` drops a NaN
    operand, so NaN elements never reach ``amax``; the fold order is then
    irrelevant because max is exact. ``d = amax / -8.0f`` (negative on purpose:
    the positive extreme maps to code 0, the only end that is not clamped).
    """
    x = np.asarray(x, dtype=np.float32)
    _check_head_dim(x.shape[-1])
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // BLOCK, BLOCK))
    amax = np.fmax.reduce(np.abs(blocks), axis=-1, initial=np.float32(0.0))
    return (amax / np.float32(-8.0)).astype(np.float32)


def _device_codes(products: np.ndarray) -> np.ndarray:
    """``clamp((int)rintf(p) + 8, 0, 15)`` with CUDA's integer semantics.

    ``(int)`` of a float is ``cvt.rzi.s32.f32``: NaN gives 0 and out-of-range
    values saturate to INT32_MIN / INT32_MAX. The ``+ 8`` is a plain 32-bit
    ``add.s32`` that wraps, so a +inf product (INT32_MAX + 8) turns negative and
    clamps to 0, not 15. That order (convert, add, clamp) is what the PTX does.
    """
    r = np.rint(products).astype(np.float64)  # rintf: round half to even
    r = np.where(np.isnan(r), 0.0, np.clip(r, _INT32_MIN, _INT32_MAX))
    q = r.astype(np.int64) + 8
    q = (q - _INT32_MIN) % (2**32) + _INT32_MIN  # wrap to int32 like add.s32
    return np.clip(q, 0, 15)


def quantize_rows(x: np.ndarray) -> np.ndarray:
    """Quantize ``x[..., head_dim]`` (float32) to ``uint8[..., row_bytes]``.

    Mirrors ``fc_kvq4_quant_block`` applied to each block of each row, as the
    append kernels (``fc_attn_kv_append_q4`` and its ``_dev`` / ``_slots``
    forms) do. ``id = 1/d`` in float32 (0 when ``d == 0``), the product
    ``x * id`` is a single float32 multiply, and the stored scale is
    ``__float2half(d)`` (round to nearest even, which numpy's cast also does).
    Inputs are converted to float32 first, as the kernel only ever sees float32.
    """
    x = np.asarray(x, dtype=np.float32)
    hd = x.shape[-1]
    _check_head_dim(hd)
    lead = x.shape[:-1]
    n_blk = hd // BLOCK
    blocks = x.reshape(lead + (n_blk, BLOCK))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        d = block_scales(x)
        nonzero = d != 0.0
        inv = np.where(nonzero, np.float32(1.0) / np.where(nonzero, d, np.float32(1.0)), 0.0)
        inv = inv.astype(np.float32)
        products = blocks * inv[..., None]  # float32 * float32, no FMA on the device either
        scale_bits = d.astype(np.float16).view(np.uint16)
    codes = _device_codes(products)
    out = np.empty(lead + (n_blk, BLOCK_BYTES), dtype=np.uint8)
    out[..., 0] = scale_bits & 0xFF
    out[..., 1] = scale_bits >> 8
    out[..., 2:] = codes[..., :_HALF_BLOCK] | (codes[..., _HALF_BLOCK:] << 4)
    return out.reshape(lead + (n_blk * BLOCK_BYTES,))


def quantize_row(x: np.ndarray) -> np.ndarray:
    """Quantize one row ``float32[head_dim]`` to ``uint8[row_bytes(head_dim)]``."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"quantize_row takes one row, got shape {x.shape}; use quantize_rows")
    return quantize_rows(x)


def dequantize_rows(rows: np.ndarray) -> np.ndarray:
    """Decode ``uint8[..., row_bytes]`` to ``float32[..., head_dim]``.

    Mirrors ``fc_kvq4_dequant_elem``: ``d`` is the binary16 scale widened to
    float32 and each element is ``(float)(code - 8) * d`` in float32. That
    product is exact (a 4-bit integer times an 11-bit significand), so the
    in-register variant ``fc_kvq4_dequant_lane_chunk`` gives the same bits.
    """
    rows = np.asarray(rows)
    if rows.dtype != np.uint8:
        raise TypeError(f"Q4_0 rows must be uint8, got {rows.dtype}")
    hd = head_dim_of(rows.shape[-1])
    lead = rows.shape[:-1]
    blk = rows.reshape(lead + (hd // BLOCK, BLOCK_BYTES))
    bits = blk[..., 0].astype(np.uint16) | (blk[..., 1].astype(np.uint16) << 8)
    d = np.ascontiguousarray(bits).view(np.float16).astype(np.float32)
    code_bytes = blk[..., 2:]
    codes = np.concatenate([code_bytes & 0xF, code_bytes >> 4], axis=-1).astype(np.int32) - 8
    with np.errstate(invalid="ignore"):
        vals = codes.astype(np.float32) * d[..., None]
    return vals.reshape(lead + (hd,))


def dequantize_row(row: np.ndarray) -> np.ndarray:
    """Decode one Q4_0 row ``uint8[row_bytes]`` to ``float32[head_dim]``."""
    row = np.asarray(row)
    if row.ndim != 1:
        raise ValueError(f"dequantize_row takes one row, got shape {row.shape}")
    return dequantize_rows(row)


class _Q4(KvFormat):
    def quantize_rows(self, x: np.ndarray, scale: float = 1.0) -> np.ndarray:
        return quantize_rows(x)

    def round_trip_bound(self, x, rows):
        """Half a step of rounding, plus up to 8 steps of the fp16 scale's error
        (|code| <= 8); x / d >= 7.5 rounds to code 16 and clamps to 15 (only negative
        x, as d < 0): a full step there."""
        x = np.asarray(x, dtype=np.float64)
        blocks = x.reshape(x.shape[:-1] + (-1, BLOCK))
        d32 = block_scales(x.astype(np.float32)).astype(np.float64)[..., None]  # negative
        blk = np.asarray(rows, dtype=np.uint8).reshape(blocks.shape[:-1] + (BLOCK_BYTES,))
        bits = blk[..., 0].astype(np.uint16) | (blk[..., 1].astype(np.uint16) << 8)
        d16 = np.ascontiguousarray(bits).view(np.float16).astype(np.float64)[..., None]
        step = np.abs(d32)
        with np.errstate(divide="ignore", invalid="ignore"):
            clamped = blocks / d32 >= 7.49
        bound = np.where(clamped, step, 0.5 * step) * (1 + 1e-6) + 8 * np.abs(d32 - d16)
        return x, bound.reshape(x.shape)

    def dequantize_rows(self, rows: np.ndarray, scale: float = 1.0) -> np.ndarray:
        return dequantize_rows(rows)


FORMAT = _Q4(
    name="q4", doc="Q4_0 blocks (fp16 scale + 16 code bytes per 32 values) with fp16 "
    "sink rows and a recent-window ring", ctype="unsigned char", dtype="uint8",
    block=BLOCK, block_width=BLOCK_BYTES, shadows=True, append_wraps=False,
    append_staging=True, register_k_lanes=BLOCK // 2, register_k_chunk_multiple=2,
    raw_v_tile=True, fp16=True, exact_elements=False, block_align=2)
