"""CPU tests of the KV-format models in kgen.formats: every registered format
generically (layout, poison, round-trip error), plus hand cases for f16 and q8_0
(q4's hand cases live in test_numpy_ref.py).

Random inputs are fresh on every run; each test records its seed in every
assertion message. Set KGEN_TEST_SEED=<seed> to replay a failure.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from kgen.formats import FORMATS, KvFormat, KvFormatName
from kgen.formats import q4 as q4_model
from kgen.formats import q8_0 as q8_model
from kgen.testing.case import bits_equal, normal

FMTS = list(FORMATS.values())
HEAD_DIMS = (32, 64, 96, 128, 256)  # accepted by every format
Q8 = FORMATS["q8_0"]
F16 = FORMATS["f16"]




def _half_bits(v: float) -> int:
    """__float2half(v) as bits (round to nearest even; overflow to inf)."""
    with np.errstate(over="ignore"):
        return int(np.array([v], np.float32).astype(np.float16).view(np.uint16)[0])


def _scales16(rows: np.ndarray, block_bytes: int) -> np.ndarray:
    """The little-endian binary16 scale of every block of uint8 rows, as float64."""
    blk = rows.reshape(rows.shape[:-1] + (-1, block_bytes))
    bits = blk[..., 0].astype(np.uint16) | (blk[..., 1].astype(np.uint16) << 8)
    return np.ascontiguousarray(bits).view(np.float16).astype(np.float64)


# ============================================================== registry and layout


def test_registry() -> None:
    assert set(FORMATS) >= {"f32", "q4", "f16", "q8_0"}
    for name, fmt in FORMATS.items():
        assert isinstance(fmt, KvFormat)
        assert fmt.name == name == str(fmt) == fmt.value
        assert fmt.template == f"kv/{name}.j2"
    assert [m.value for m in KvFormatName] == list(FORMATS)
    for name, fmt in FORMATS.items():
        assert KvFormatName(name).fmt is fmt


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_flags_agree_with_the_model(fmt) -> None:
    names = [s.name for s in fmt.shadow_buffers()]
    if fmt.shadows:
        assert names == ["k_sink", "v_sink", "k_win", "v_win"]
        assert fmt.shadow_scalars() == ("sink", "win")
        assert {s.rows_key for s in fmt.shadow_buffers()} == {"sink_rows", "ring_rows"}
    else:
        assert names == [] and fmt.shadow_scalars() == ()
    assert fmt.itemsize == np.dtype(fmt.dtype).itemsize
    # exact_elements: the body gives back the float32 values bit for bit.
    x = np.array([1.0 + 2.0**-20, -3.0e-3, 7.0, 1.0e5] * 8, np.float32)
    exact = bits_equal(fmt.dequantize_rows(fmt.quantize_rows(x)), x)
    assert exact == fmt.exact_elements


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_accepts_head_dim(fmt) -> None:
    for hd in range(0, 300):
        assert fmt.accepts_head_dim(hd) == (hd >= fmt.block and hd % fmt.block == 0), hd
        if hd and not fmt.accepts_head_dim(hd):
            with pytest.raises(ValueError):
                fmt.quantize_rows(np.zeros(hd, np.float32))
    for hd in (64, 128, 256):  # the kernels' head dims
        assert fmt.accepts_head_dim(hd)
    assert not fmt.accepts_head_dim(0) and not fmt.accepts_head_dim(-fmt.block)


@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_row_width_and_bytes_match_quantize_output(rng, fmt, hd) -> None:
    r, seed = rng
    msg = f"{fmt} hd={hd} seed={seed}"
    assert fmt.row_width(hd) == hd // fmt.block * fmt.block_width, msg
    assert fmt.row_bytes(hd) == fmt.row_width(hd) * fmt.itemsize, msg
    x = normal(r, (3, 2, hd), 2.0)
    q = fmt.quantize_rows(x)
    assert q.dtype == np.dtype(fmt.dtype), msg
    assert q.shape == (3, 2, fmt.row_width(hd)), msg
    assert q[0, 0].nbytes == fmt.row_bytes(hd), msg
    back = fmt.dequantize_rows(q)
    assert back.dtype == np.float32 and back.shape == x.shape, msg
    # Batched rows equal rows one at a time, and a 1-D row works.
    for i in range(3):
        for h in range(2):
            assert np.array_equal(fmt.quantize_rows(x[i, h]), q[i, h]), msg
            assert bits_equal(fmt.dequantize_rows(q[i, h]), back[i, h]), msg
    # Inputs are float32 to the kernels: wider inputs are converted first.
    x64 = x.astype(np.float64) * (1 + 2.0**-30)
    assert np.array_equal(fmt.quantize_rows(x64), fmt.quantize_rows(x64.astype(np.float32))), msg


def test_q4_and_q8_0_block_geometry() -> None:
    assert (q4_model.BLOCK, q4_model.BLOCK_BYTES) == (FORMATS["q4"].block,
                                                      FORMATS["q4"].block_width) == (32, 18)
    assert (q8_model.BLOCK, q8_model.BLOCK_BYTES) == (Q8.block, Q8.block_width) == (32, 34)
    assert Q8.row_bytes(128) == 136 and FORMATS["q4"].row_bytes(128) == 72
    assert F16.row_bytes(128) == 256 and FORMATS["f32"].row_bytes(128) == 512


@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("hd", (32, 128))
def test_poison_decodes_to_nan(fmt, hd) -> None:
    rows = np.full((2, 3, fmt.row_width(hd)), fmt.poison(), dtype=fmt.dtype)
    back = fmt.dequantize_rows(rows)
    assert back.shape == (2, 3, hd) and np.all(np.isnan(back))


# ============================================================== round-trip error


def test_every_format_declares_its_error_model() -> None:
    for fmt in FMTS:
        x = np.linspace(-2, 2, 64, dtype=np.float32).reshape(1, 64)
        target, bound = fmt.round_trip_bound(x, fmt.quantize_rows(x))
        assert target.shape == bound.shape == x.shape and np.all(bound >= 0), fmt


def _check_round_trip(fmt, x, q, back, msg) -> None:
    """``back`` within the format's declared bound of its target (inf where it overflows),
    and f32 bit for bit; where the format keeps a float type NumPy has (f16), NumPy's own
    rounding agrees."""
    target, bound = fmt.round_trip_bound(x, q)
    over = np.isinf(target)
    assert np.all(back[over] == target[over]), msg
    assert np.all(np.isfinite(back[~over])), msg
    err = np.abs(back[~over].astype(np.float64) - target[~over])
    assert np.all(err <= bound[~over]), msg
    if not bound.any():
        assert back.tobytes() == x.tobytes(), f"{fmt} must round-trip bit for bit, {msg}"
    if np.dtype(fmt.dtype).kind == "f":
        with np.errstate(over="ignore"):
            assert bits_equal(back, x.astype(fmt.dtype).astype(np.float32)), msg


def _with_exact_scales(r: np.random.Generator, x: np.ndarray) -> np.ndarray:
    """Rescale every other block so amax = 127 * 2^k: q8_0's d = 2^k is exact in fp16."""
    b = x.reshape(-1, 32).astype(np.float64)
    for i in range(0, b.shape[0], 2):
        amax = np.abs(b[i]).max()
        if not 0 < amax < 1e30:
            continue
        target = 127.0 * 2.0 ** round(math.log2(amax / 127))
        j = int(np.abs(b[i]).argmax())
        b[i] *= target / amax * 0.999
        b[i, j] = math.copysign(target, b[i, j])
    return b.astype(np.float32).reshape(x.shape)


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_round_trip_error_bound(rng, fmt) -> None:
    r, seed = rng
    for scale in (1e-9, 1e-6, 1e-3, 1.0, 50.0, 3e4):
        x = _with_exact_scales(r, normal(r, (16, 256), scale))
        q = fmt.quantize_rows(x)
        back = fmt.dequantize_rows(q)
        _check_round_trip(fmt, x, q, back, f"{fmt} scale={scale} seed={seed}")


@pytest.mark.parametrize("fmt", [f for f in FMTS if f.name != "q4"], ids=str)
def test_requantizing_decoded_rows_is_a_fixed_point(rng, fmt) -> None:
    """Decoded rows re-encode to the same rows (f32, f16, q8_0: the amax code is +-127
    and 127 * d16 / 127 gives d16 back). Not q4: a clamped negative extreme decodes to
    -7 * |d|, which changes the next amax."""
    r, seed = rng
    for scale in (1e-3, 1.0, 50.0):
        q = fmt.quantize_rows(normal(r, (8, 128), scale))
        again = fmt.quantize_rows(fmt.dequantize_rows(q))
        assert again.tobytes() == q.tobytes(), f"{fmt} scale={scale} seed={seed}"


# ============================================================== f16 hand cases


F16_CASES = [  # float32 value -> binary16 bits (round to nearest even, as __float2half)
    (1.0, 0x3C00),
    (1.0 + 2.0**-11, 0x3C00),                 # tie -> even (down)
    (1.0 + 3 * 2.0**-11, 0x3C02),             # tie -> even (up)
    (1.0 + 2.0**-11 + 2.0**-23, 0x3C01),      # just above the tie
    (1.0 + 2.0**-11 - 2.0**-23, 0x3C00),      # just below the tie
    (2049.0, 0x6800),                         # spacing 2: tie -> 2048
    (2051.0, 0x6802),                         # tie -> 2052
    (-0.0, 0x8000),
    (65504.0, 0x7BFF),                        # largest finite half
    (65519.0, 0x7BFF),
    (65520.0, 0x7C00),                        # tie between 65504 and 2^16 -> even: inf
    (-65520.0, 0xFC00),
    (1.0e6, 0x7C00),
    (float(np.finfo(np.float32).max), 0x7C00),
    (float("inf"), 0x7C00),
    (float("-inf"), 0xFC00),
    (2.0**-14, 0x0400),                       # smallest normal
    (2.0**-14 - 2.0**-25, 0x0400),            # tie between 0x03FF and 0x0400 -> even
    (2.0**-24, 0x0001),                       # smallest subnormal
    (2.0**-25, 0x0000),                       # tie between 0 and 2^-24 -> even: 0
    (2.0**-25 * (1 + 2.0**-23), 0x0001),      # just above
    (3 * 2.0**-25, 0x0002),                   # tie -> even (up)
    (-(2.0**-25), 0x8000),
    (2.0**-26, 0x0000),
]


def test_f16_hand_cases() -> None:
    x = np.array([v for v, _ in F16_CASES], np.float32)
    assert [float(v) for v in x] == [v for v, _ in F16_CASES], "every case is a float32"
    q = F16.quantize_rows(x)
    assert q.dtype == np.float16
    assert [hex(b) for b in q.view(np.uint16).tolist()] == [hex(b) for _, b in F16_CASES]
    back = F16.dequantize_rows(q)
    want = np.array([b for _, b in F16_CASES], np.uint16).view(np.float16).astype(np.float32)
    assert bits_equal(back, want)
    nan = F16.quantize_rows(np.array([np.nan], np.float32))
    assert np.isnan(nan[0]) and np.isnan(F16.dequantize_rows(nan)[0])


# ============================================================== q8_0 hand cases


def _i8(codes: list[int]) -> list[int]:
    return [c & 0xFF for c in codes]


def _q8_block(bits: int, codes: list[int]) -> list[int]:
    """Bytes of one Q8_0 block: fp16 scale little-endian, then 32 int8 codes."""
    codes = codes + [0] * (32 - len(codes))
    return [bits & 0xFF, bits >> 8] + _i8(codes)


def test_q8_0_rounds_half_away_from_zero() -> None:
    # amax 127 -> d = 1, id = 1: every code is roundf(x) (llama.cpp's rounding, not rint).
    vals = [127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, float(np.nextafter(np.float32(0.5), 0)),
            -127.0, 126.5, -126.5, 3.4, -3.6, -0.0]
    codes = [127, 3, -3, 1, -1, 2, -2, 0, -127, 127, -127, 3, -4, 0]
    x = np.zeros(32, np.float32)
    x[:len(vals)] = vals
    q = Q8.quantize_rows(x)
    assert q.dtype == np.uint8 and q.shape == (34,)
    assert q.tolist() == _q8_block(0x3C00, codes)
    assert Q8.dequantize_rows(q).tolist() == [float(c) for c in codes] + [0.0] * (32 - len(codes))
    # The same products under q4's rint would round the ties to even.
    assert [int(v) for v in np.rint(np.array(vals[1:7]))] == [2, -2, 0, 0, 2, -2]


def test_q8_0_scale_is_amax_over_127_in_float32() -> None:
    x = np.zeros(32, np.float32)
    x[:3] = [1.0, -0.3, 0.25]
    d = np.float32(1.0) / np.float32(127.0)        # 0.007874016
    assert _half_bits(d) == 0x2008                  # 2^-7 * (1 + 8/1024)
    inv = np.float32(1.0) / d
    assert (x[:3] * inv).tolist() == pytest.approx([127, -38.1, 31.75], abs=1e-4)
    q = Q8.quantize_rows(x)
    assert q.tolist() == _q8_block(0x2008, [127, -38, 32])  # bytes 0-1: 0x08, 0x20
    d16 = np.float32(2.0**-7 * (1 + 8 / 1024))
    assert Q8.dequantize_rows(q)[:3].tolist() == [float(np.float32(c) * d16)
                                                  for c in (127, -38, 32)]


def test_q8_0_scale_little_endian_and_positive_for_a_negative_amax() -> None:
    # amax = 127 * (1 + 2^-10) exactly, at a negative element: d = 1 + 2^-10 = 0x3C01
    # (non-zero low byte first), positive (unlike q4's d = amax / -8).
    x = np.zeros(32, np.float32)
    x[:3] = [-127.0 * (1 + 2.0**-10), 10.0, 50.0]
    assert np.float32(abs(x[0])) / np.float32(127) == np.float32(1 + 2.0**-10)
    q = Q8.quantize_rows(x)
    assert q[:2].tolist() == [0x01, 0x3C]
    assert q.tolist() == _q8_block(0x3C01, [-127, 10, 50])
    assert q[2] == 0x81  # -127 as int8 two's complement


def test_q8_0_zero_blocks_and_block_order() -> None:
    zero = Q8.quantize_rows(np.zeros(32, np.float32))
    assert zero.tolist() == [0] * 34  # d = 0, id = 0, every code 0
    neg_zero = Q8.quantize_rows(np.full(32, -0.0, np.float32))
    assert neg_zero.tolist() == [0] * 34  # amax = |-0| = +0: d = +0 (q4 stores -0 here)
    assert np.all(Q8.dequantize_rows(zero) == 0)
    # Element j of block b is byte 34 b + 2 + j: no nibble interleave, blocks in order.
    ramp = 127.0 - 8.0 * np.arange(32, dtype=np.float32)  # 127 .. -121, amax 127, d = 1
    x = np.concatenate([np.zeros(32, np.float32), ramp, -ramp])
    q = Q8.quantize_rows(x)
    assert q.shape == (102,)
    assert q[:34].tolist() == [0] * 34
    assert q[34:68].tolist() == _q8_block(0x3C00, [int(v) for v in ramp])
    assert q[68:].tolist() == _q8_block(0x3C00, [-int(v) for v in ramp])
    assert Q8.dequantize_rows(q).tolist() == x.tolist()


def test_q8_0_special_values() -> None:
    # fmaxf drops the NaN: amax 127, d = 1; the NaN element gets code 0 ((int) NaN = 0).
    x = np.zeros(32, np.float32)
    x[:4] = [np.nan, 127.0, -63.5, 0.3]
    q = Q8.quantize_rows(x)
    assert q.tolist() == _q8_block(0x3C00, [0, 127, -64, 0])
    assert Q8.dequantize_rows(q)[0] == 0.0

    # inf: d = inf (fp16 0x7C00), id = 1/inf = 0, every product 0 or NaN -> code 0;
    # the block decodes to 0 * inf = NaN.
    x = np.zeros(32, np.float32)
    x[:3] = [np.inf, 1.0, -1.0]
    q = Q8.quantize_rows(x)
    assert q.tolist() == _q8_block(0x7C00, [])
    assert np.all(np.isnan(Q8.dequantize_rows(q)))

    # Huge finite values: the fp16 scale overflows to inf, the codes are ordinary.
    x = np.zeros(32, np.float32)
    x[:3] = [3.0e38, -3.0e38, 1.0e38]
    assert Q8.quantize_rows(x).tolist() == _q8_block(0x7C00, [127, -127, 42])

    # A subnormal d: 1/d overflows to inf, so products saturate the device's (int)
    # conversion and clamp to 127 / -128; 0 * inf = NaN -> 0. The fp16 scale is 0.
    # (Device semantics, as the model documents; llama.cpp's C conversion is UB here.)
    x = np.zeros(32, np.float32)
    x[:2] = [2.0**-130, -(2.0**-130)]
    assert Q8.quantize_rows(x).tolist() == _q8_block(0x0000, [127, -128])


def test_q8_0_rejects_partial_blocks() -> None:
    with pytest.raises(ValueError):
        Q8.quantize_rows(np.zeros(48, np.float32))
    with pytest.raises(ValueError):
        Q8.dequantize_rows(np.zeros(40, np.uint8))


# ============================================================== q8_0 scalar transcription


def _roundf(p: float) -> int:
    """C roundf, exactly (rational arithmetic): half away from zero."""
    return int(math.copysign(math.floor(abs(Fraction(p)) + Fraction(1, 2)), p))


def _scalar_q8_0(x: np.ndarray) -> list[int]:
    """llama.cpp's quantize_row_q8_0_ref, one float32 scalar at a time, with the
    device's (int) conversion (NaN -> 0, saturating) and clamp to int8."""
    out: list[int] = []
    f32 = np.float32
    for b in range(len(x) // 32):
        blk = [f32(v) for v in x[32 * b:32 * b + 32]]
        amax = f32(0.0)
        for v in blk:
            av = f32(abs(v))
            if not math.isnan(av) and av > amax:  # fmaxf keeps the non-NaN operand
                amax = av
        with np.errstate(all="ignore"):
            d = f32(amax / f32(127.0))
            inv = f32(f32(1.0) / d) if d != 0 else f32(0.0)
        bits = _half_bits(d)
        out += [bits & 0xFF, bits >> 8]
        for v in blk:
            with np.errstate(all="ignore"):
                p = float(f32(v * inv))
            if math.isnan(p):
                c = 0
            elif math.isinf(p):
                c = 127 if p > 0 else -128
            else:
                c = min(max(_roundf(p), -128), 127)
            out.append(c & 0xFF)
    return out


def _scalar_dequantize_q8_0(row: np.ndarray) -> np.ndarray:
    out = np.empty(len(row) // 34 * 32, np.float32)
    for e in range(out.size):
        blk = row[34 * (e // 32):34 * (e // 32) + 34]
        d = np.float32(np.array([int(blk[0]) | (int(blk[1]) << 8)], np.uint16)
                       .view(np.float16)[0])
        c = int(blk[2 + e % 32])
        c = c - 256 if c > 127 else c
        with np.errstate(all="ignore"):
            out[e] = np.float32(c) * d
    return out


def test_q8_0_matches_scalar_transcription(rng) -> None:
    r, seed = rng
    rows = [normal(r, (128,), s) for s in (1e-30, 1e-3, 1.0, 1e4, 1e36)]
    ties = r.integers(-254, 255, 128).astype(np.float32) / np.float32(2.0)
    ties[::32] = 127.0  # d = 1: every odd half is a tie
    rows.append(ties)
    rows.append(ties * np.float32(2.0**-3))  # d = 2^-3, still exact ties
    # Arbitrary bit patterns: NaN, inf, subnormals, huge values.
    rows.append(np.frombuffer(r.bytes(4 * 128), dtype=np.float32).copy())
    rows.append((normal(r, (128,), 1.0) * np.float32(2.0**-126)).astype(np.float32))
    for i, x in enumerate(rows):
        q = Q8.quantize_rows(x)
        assert q.tolist() == _scalar_q8_0(x), f"row {i}, seed={seed}"
        assert bits_equal(Q8.dequantize_rows(q), _scalar_dequantize_q8_0(q)), \
            f"row {i}, seed={seed}"


# ============================================================== fp8 e4m3 hand cases

FP8_CASES = [  # float32 value -> e4m3fn byte (round to nearest even, saturating)
    (0.0, 0x00), (-0.0, 0x80), (1.0, 0x38), (-2.0, 0xC0), (448.0, 0x7E), (500.0, 0x7E),
    (float("inf"), 0x7E), (float("-inf"), 0xFE), (float("nan"), 0x7F),
    (2.0**-6, 0x08),                   # smallest normal
    (2.0**-9, 0x01),                   # smallest subnormal
    (2.0**-10, 0x00),                  # tie below the smallest subnormal -> even (0)
    (3 * 2.0**-10, 0x02),              # tie -> even (2 * 2^-9)
    (1.0 + 2.0**-4, 0x38),             # tie between 1 and 1.125 -> even (1)
    (1.0 + 3 * 2.0**-4, 0x3A),         # tie between 1.125 and 1.25 -> even (1.25)
    (15.5, 0x58),                      # 1.9375 * 2^3: tie, odd -> carries to 2^4
]


@pytest.mark.parametrize("value,code", FP8_CASES)
def test_fp8_e4m3_hand_cases(value, code) -> None:
    from kgen.formats import fp8_e4m3

    got = int(fp8_e4m3.encode(np.array([value], np.float32))[0])
    assert got == code, f"{value!r} -> {got:#04x}, want {code:#04x}"


def test_fp8_e4m3_decodes_every_byte_and_scales() -> None:
    from kgen.formats import fp8_e4m3

    b = np.arange(256, dtype=np.uint8)
    d = fp8_e4m3.decode(b)
    ok = ~np.isnan(d)
    assert set(b[~ok]) == {0x7F, 0xFF} and float(np.nanmax(d)) == 448.0
    assert np.array_equal(fp8_e4m3.encode(d[ok]), b[ok])  # every finite byte round-trips
    fmt = FORMATS["fp8_e4m3"]
    x = np.array([[1.0, -3.0, 1000.0]], np.float32)
    rows = fmt.quantize_rows(x, 0.5)  # stores x / 0.5, saturated
    assert np.array_equal(fmt.dequantize_rows(rows, 0.5), [[1.0, -3.0, 224.0]])


def test_fp8_e4m3_device_shift_decode_matches_the_model_on_every_byte() -> None:
    """templates/lib/fp8_e4m3.cuh.j2 decodes a byte at the top of a word with an
    arithmetic shift by 4, a mask and a product with 2^120 (denormals kept), and
    selects the NaN; transcribed here, it gives decode's bits for all 256 bytes, and
    the four-byte NaN test flags exactly the words holding a NaN byte."""
    from kgen.formats import fp8_e4m3

    b = np.arange(256, dtype=np.uint32)
    top = (b << 24).astype(np.uint32).view(np.int32)
    bits = ((top >> 4) & np.int32(0x87F00000 - (1 << 32))).view(np.float32)
    got = (bits * np.float32(2.0**120)).astype(np.float32)
    got = np.where((b & 0x7F) == 0x7F, np.float32(np.nan), got)
    want = fp8_e4m3.decode(b.astype(np.uint8))
    assert bits_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    rng = np.random.default_rng(0)
    words = np.concatenate([rng.integers(0, 2**32, 4096, dtype=np.uint64),
                            np.arange(256, dtype=np.uint64) << np.uint64(8 * 2)])
    words = words.astype(np.uint32)
    flagged = (((words & 0x7F7F7F7F) + 0x01010101) & 0x80808080) != 0
    has_nan = np.zeros(words.shape, bool)
    for i in range(4):
        has_nan |= ((words >> (8 * i)) & 0x7F) == 0x7F
    assert np.array_equal(flagged, has_nan) and has_nan.any() and not has_nan.all()


def test_q8_0_device_byte_permute_decode_matches_the_cast_on_every_code() -> None:
    """templates/lib/q8_0.cuh.j2 turns a code into a float as the low byte of 2^23's
    bits (the code offset by 128) minus 2^23 + 128: exactly (float)code for all 256."""
    c = np.arange(256, dtype=np.uint32)
    got = ((np.uint32(0x4B000000) | (c ^ 0x80)).view(np.float32)
           - np.float32(8388736.0)).astype(np.float32)
    assert np.array_equal(got, c.astype(np.uint8).view(np.int8).astype(np.float32))


def _byte_perm(x: int, y: int, s: int) -> int:
    """CUDA's __byte_perm(x, y, s) (default mode): result byte n is byte s's nibble n of
    the eight bytes x (0-3) then y (4-7)."""
    src = (x | (y << 32)).to_bytes(8, "little")
    return int.from_bytes(bytes(src[(s >> (4 * n)) & 7] for n in range(4)), "little")


def test_q4_device_quad_decode_matches_the_format_on_every_code_word() -> None:
    """templates/lib/q4.cuh.j2's kgen_q4_quad: the code bytes of elements [E, E + 4) of a
    Q4_0 block, as the word two 16-bit loads give (kv/q4.j2, load_quad_raw), shifted to
    the quad's nibble (E & 16) and masked; each code the low byte of 2^23's bits, minus
    2^23 + 8, times d: exactly what q4.dequantize_rows gives, for every code in either
    nibble and every place of the quad in its block."""
    g = np.random.default_rng(7)
    scale = np.float16(-0.37)
    d = np.float32(scale)
    rows = g.integers(0, 256, size=(64, q4_model.BLOCK_BYTES), dtype=np.uint8)
    rows[:, 0:2] = np.frombuffer(scale.tobytes(), np.uint8)  # little-endian fp16 scale
    rows[:16, 2:] = (np.arange(16, dtype=np.uint8) * 0x11)[:, None]  # every code, both nibbles
    want = q4_model.dequantize_rows(rows)
    for r, row in enumerate(rows):
        for e in range(0, q4_model.BLOCK, 4):
            lo = 2 + (e & 15)
            c01 = int(row[lo]) | int(row[lo + 1]) << 8
            c23 = int(row[lo + 2]) | int(row[lo + 3]) << 8
            u = ((c01 | c23 << 16) >> ((e & 16) >> 2)) & 0x0F0F0F0F
            for i in range(4):
                bits = _byte_perm(u, 0x4B000000, 0x7540 | i)
                v = np.uint32(bits).view(np.float32) - np.float32(8388616.0)
                assert np.float32(v * d) == want[r, e + i], (r, e, i)
