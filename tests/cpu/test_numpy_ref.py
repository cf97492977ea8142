"""CPU tests of kgen.numpy_ref, the NumPy reference the GPU kernels are checked against.

Random inputs are fresh on every run; each test records its seed in every
assertion message. Set KGEN_TEST_SEED=<seed> to replay a failure.

The format models themselves (every registered format, generically) are tested
in test_formats.py; the q4 bit-level cases stay here next to the shadows they feed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen.formats import FORMATS
from kgen.formats.q4 import (
    BLOCK,
    BLOCK_BYTES,
    block_scales,
    dequantize_row,
    dequantize_rows,
    head_dim_of,
    quantize_row,
    quantize_rows,
    row_bytes,
)
from kgen.ir.axes import KEYS
from kgen.numpy_ref import (
    SRC_BODY,
    SRC_SINK,
    SRC_WINDOW,
    HostCache,
    append,
    append_dev,
    append_rows,
    append_slots,
    attended_keys,
    combine,
    decode_attention,
    decode_attention_slots,
    decode_partials,
    decode_partials_slots,
    decode_plan,
    fill,
    keys_scored_per_tile,
    nominal_window_keys,
    prefill_attention,
    prefill_attention_cache,
    prefill_live_floor,
    qz_split,
    read_kv_rows,
    shadow_source,
    split_bounds,
    tile_in_window,
)
from kgen.testing.case import bits_equal, normal

Q4 = FORMATS["q4"]
FMTS = list(FORMATS.values())
WRAPPING = [f for f in FMTS if f.append_wraps]

# The reference kernels' spec values (what WMAX / SINKMAX used to be) ...
RING_ROWS, SINK_ROWS = 256, 8
# ... and another geometry, to show the model is parametric in both.
CACHE_GEOMETRIES = [(RING_ROWS, SINK_ROWS), (64, 16)]
TILES = (8, 16, 32)




def _f16(x: np.ndarray) -> np.ndarray:
    """float32 -> binary16 -> float32, as __float2half then __half2float."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def _snapshot(cache: HostCache) -> list[bytes]:
    return [a.tobytes() for a in cache.arrays]


# Outputs are convex combinations of V rows (|v| ~ 1); a component that cancels to
# ~1e-5 cannot keep 1e-12 relative accuracy, hence a small absolute floor too.
RTOL, ATOL = 1e-12, 1e-13


def _direct_attention(qv: np.ndarray, keys: np.ndarray, vals: np.ndarray, scale: float
                      ) -> np.ndarray:
    """Textbook single-pass softmax attention of one query, in float64."""
    s = keys.astype(np.float64) @ qv.astype(np.float64) * float(np.float32(scale))
    p = np.exp(s - s.max())
    return (p @ vals.astype(np.float64)) / p.sum()


def test_spec_geometry_values() -> None:
    # The explicit sizes used here are the reference kernels' spec defaults.
    assert KEYS["ring_rows"].default == RING_ROWS
    assert KEYS["sink_rows"].default == SINK_ROWS
    assert KEYS["tile_keys"].default == 16 and 16 in TILES


# ============================================================== q4 format

# x[j] = j - 16: amax 16, d = -2, id = -0.5, products (16 - j) / 2 hit every
# half-way case (round half to even), both clamps, and both nibbles.
HAND_X = np.arange(32, dtype=np.float32) - 16
HAND_BYTES = [0x00, 0xC0,  # binary16 -2.0, little-endian
              0x8F, 0x8F, 0x7F, 0x6E, 0x6E, 0x6E, 0x5D, 0x4C,
              0x4C, 0x4C, 0x3B, 0x2A, 0x2A, 0x2A, 0x19, 0x08]
HAND_DECODED = [-14, -14, -14, -12, -12, -12, -10, -8, -8, -8, -6, -4, -4, -4, -2, 0,
                0, 0, 2, 4, 4, 4, 6, 8, 8, 8, 10, 12, 12, 12, 14, 16]


def test_row_bytes() -> None:
    assert (BLOCK, BLOCK_BYTES) == (32, 18)
    assert row_bytes(32) == 18
    assert row_bytes(128) == 72
    assert row_bytes(256) == 144
    for hd in (32, 64, 128, 256):
        assert head_dim_of(row_bytes(hd)) == hd
        assert Q4.row_bytes(hd) == Q4.row_width(hd) == row_bytes(hd)  # uint8 rows
    with pytest.raises(ValueError):
        row_bytes(48)
    with pytest.raises(ValueError):
        head_dim_of(20)


def test_hand_block_rounding_clamping_and_nibbles() -> None:
    q = quantize_row(HAND_X)
    assert q.dtype == np.uint8
    assert q.tolist() == HAND_BYTES
    assert dequantize_row(q).tolist() == HAND_DECODED
    assert np.array_equal(Q4.quantize_rows(HAND_X), q)  # the format object is the model
    assert Q4.dequantize_rows(q).tolist() == HAND_DECODED
    assert block_scales(HAND_X).tolist() == [-2.0]
    # Low nibble = element j, high nibble = element j + 16.
    assert [b & 0xF for b in q[2:]] == [15, 15, 15, 14, 14, 14, 13, 12, 12, 12, 11, 10, 10, 10, 9,
                                        8]
    assert [b >> 4 for b in q[2:]] == [8, 8, 7, 6, 6, 6, 5, 4, 4, 4, 3, 2, 2, 2, 1, 0]


def test_zero_block_next_to_live_block() -> None:
    x = np.concatenate([np.zeros(32, np.float32), HAND_X])
    x[3] = -0.0
    q = quantize_row(x)
    # amax 0 -> d = 0 / -8 = -0.0 (binary16 0x8000), id = 0, every code 8.
    assert q[:18].tolist() == [0x00, 0x80] + [0x88] * 16
    assert q[18:].tolist() == HAND_BYTES
    back = dequantize_row(q)
    assert np.all(back[:32] == 0) and np.all(np.signbit(back[:32]))  # 0 * -0.0 = -0.0
    assert back[32:].tolist() == HAND_DECODED


def test_scale_is_negative_and_positive_extreme_is_exact(rng) -> None:
    r, seed = rng
    x = normal(r, (64, 256), 3.0)
    q = quantize_rows(x).reshape(64, 8, 18)
    assert np.all(q[..., 1] & 0x80), f"every scale must carry the sign bit, seed={seed}"
    blocks = x.reshape(64, 8, 32)
    amax = np.abs(blocks).max(-1)
    d = (q[..., 0].astype(np.uint16) | (q[..., 1].astype(np.uint16) << 8)).view(np.float16)
    np.testing.assert_allclose(d.astype(np.float64), -amax / 8.0, rtol=2.0**-11,
                               err_msg=f"seed={seed}")
    # The stored scale is block_scales (float32) rounded to binary16.
    assert np.array_equal(d, block_scales(x).astype(np.float16)), f"seed={seed}"
    # The element with the largest positive value in a block whose max is positive
    # gets code 0 and decodes to -8 * d ~ +amax.
    deq = dequantize_rows(q.reshape(64, 144)).reshape(64, 8, 32)
    pos_max = blocks.max(-1) == amax
    arg = blocks.argmax(-1)
    got = np.take_along_axis(deq, arg[..., None], -1)[..., 0]
    np.testing.assert_allclose(got[pos_max], amax[pos_max], rtol=2.0**-11, err_msg=f"seed={seed}")


def test_special_values() -> None:
    inf_block = np.ones(32, np.float32)
    inf_block[3] = np.inf
    # d = -inf, id = -0: finite * -0 = -0 -> code 8, inf * -0 = NaN -> (int) 0 -> code 8.
    assert quantize_row(inf_block).tolist() == [0x00, 0xFC] + [0x88] * 16
    assert np.all(np.isnan(dequantize_row(quantize_row(inf_block))))

    nan_block = np.zeros(32, np.float32)
    nan_block[:3] = [np.nan, 1.0, -2.0]
    # fmaxf drops the NaN: amax 2, d = -0.25 (0xB400), id = -4; NaN -> code 8.
    assert quantize_row(nan_block).tolist() == [0x00, 0xB4, 0x88, 0x84, 0x8F] + [0x88] * 13

    tiny = np.zeros(32, np.float32)
    tiny[:4] = [2.0**-126, -(2.0**-126), 2.0**-127, 2.0**-149]
    # d = -2^-129 is subnormal, 1/d overflows to -inf. Positive x -> -inf -> INT_MIN
    # -> code 0; negative x -> +inf -> INT_MAX, + 8 wraps negative -> code 0 (not 15);
    # zeros -> NaN -> code 8. Observed bit for bit on an H200 (nvcc default flags).
    assert quantize_row(tiny).tolist() == [0x00, 0x80] + [0x80] * 4 + [0x88] * 12

    huge = np.zeros(32, np.float32)
    huge[:2] = [3.0e38, -3.0e38]
    # Scale overflows binary16 to -inf; the codes are still the ordinary ones.
    assert quantize_row(huge).tolist() == [0x00, 0xFC, 0x80, 0x8F] + [0x88] * 14


def test_round_trip_error_bounds(rng) -> None:
    r, seed = rng
    for scale in (1e-3, 1.0, 50.0):
        x = normal(r, (32, 256), scale)
        back = dequantize_rows(quantize_rows(x))
        assert back.dtype == np.float32 and back.shape == x.shape
        err = np.abs(back.astype(np.float64) - x).reshape(32, 8, 32)
        blocks = x.reshape(32, 8, 32).astype(np.float64)
        step = np.abs(blocks).max(-1, keepdims=True) / 8.0  # |d|
        # x / d >= 7.5 rounds to code 16 and clamps to 15 (only negative x: d < 0).
        free = ~(blocks < -7.49 * step)
        bound = (0.5 + 8 * 2.0**-11) * np.broadcast_to(step, err.shape)
        # Half a step of rounding plus the binary16 scale error (<= 8 * |d| * 2^-11).
        assert np.all(err[free] <= bound[free]), f"seed={seed} scale={scale}"
        assert np.all(err <= (1.0 + 8 * 2.0**-11) * step), f"seed={seed} scale={scale}"
        rel = np.sqrt((err**2).mean()) / np.sqrt((blocks**2).mean())
        assert rel < 0.12, f"seed={seed} scale={scale} rms rel err {rel}"


def _scalar_quantize(x: np.ndarray) -> list[int]:
    """Straight transcription of the device quantizer, one scalar at a time."""
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
            d = f32(amax / f32(-8.0))
            inv = f32(f32(1.0) / d) if d != 0 else f32(0.0)
            bits = int(np.array([d]).astype(np.float16).view(np.uint16)[0])
        out += [bits & 0xFF, bits >> 8]

        def code(v: np.float32, inv: np.float32 = inv) -> int:
            with np.errstate(all="ignore"):
                p = np.rint(f32(v * inv))
            # (int) saturates and maps NaN to 0
            i = 0 if math.isnan(p) else int(max(min(float(p), 2.0**31 - 1), -(2.0**31)))
            i = (i + 8 + 2**31) % 2**32 - 2**31  # 32-bit add wraps
            return min(max(i, 0), 15)

        out += [code(blk[j]) | (code(blk[j + 16]) << 4) for j in range(16)]
    return out


def _scalar_dequantize(row: np.ndarray) -> np.ndarray:
    hd = len(row) // 18 * 32
    out = np.empty(hd, np.float32)
    for e in range(hd):
        blk = row[18 * (e // 32):18 * (e // 32) + 18]
        d = np.float32(np.array([int(blk[0]) | (int(blk[1]) << 8)], np.uint16).view(np.float16)[0])
        local = e % 32
        c = (int(blk[2 + local % 16]) >> (0 if local < 16 else 4)) & 0xF
        with np.errstate(all="ignore"):
            out[e] = np.float32(c - 8) * d
    return out


def test_quantize_matches_scalar_transcription(rng) -> None:
    r, seed = rng
    rows = [normal(r, (128,), s) for s in (1e-30, 1e-3, 1.0, 1e4)]
    rows.append(r.integers(-20, 20, 128).astype(np.float32) / np.float32(4.0))  # many ties
    # Arbitrary bit patterns: NaN, inf, subnormals, huge values.
    rows.append(np.frombuffer(r.bytes(4 * 128), dtype=np.float32).copy())
    tiny = normal(r, (128,), 1.0) * np.float32(2.0**-126)
    rows.append(tiny.astype(np.float32))
    for i, x in enumerate(rows):
        q = quantize_row(x)
        assert q.tolist() == _scalar_quantize(x), f"row {i}, seed={seed}"
        assert bits_equal(dequantize_row(q), _scalar_dequantize(q)), f"row {i}, seed={seed}"


def test_batched_shapes_match_single_rows(rng) -> None:
    r, seed = rng
    x = normal(r, (3, 2, 64), 2.0)
    q = quantize_rows(x)
    assert q.shape == (3, 2, 36)
    for i in range(3):
        for h in range(2):
            assert np.array_equal(q[i, h], quantize_row(x[i, h])), f"seed={seed}"
            assert bits_equal(dequantize_rows(q)[i, h], dequantize_row(q[i, h])), f"seed={seed}"
    with pytest.raises(ValueError):
        quantize_row(x[0])
    with pytest.raises(ValueError):
        dequantize_row(q[0])


# ============================================================== host caches


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_host_cache_layout_and_poison(fmt) -> None:
    n_kv, max_seq, hd, ring, sink_rows = 3, 20, 64, 32, 4
    c = HostCache.empty(fmt.name, n_kv, max_seq, hd, ring_rows=ring, sink_rows=sink_rows)
    assert c.fmt is fmt
    for body in (c.k, c.v):
        assert body.shape == (n_kv, max_seq, fmt.row_width(hd))
        assert body.dtype == np.dtype(fmt.dtype)
        assert np.all(np.isnan(fmt.dequantize_rows(body))), "unwritten rows decode to NaN"
    assert (c.head_dim, c.max_seq, c.n_head_kv) == (hd, max_seq, n_kv)
    names = [s.name for s in fmt.shadow_buffers()]
    assert list(c.shadows) == names
    assert len(c.arrays) == 2 + len(names)
    assert c.arrays[0] is c.k and c.arrays[1] is c.v
    for a, name in zip(c.arrays[2:], names, strict=True):
        assert a is c.shadows[name]
        rows = sink_rows if name.endswith("_sink") else ring
        assert a.shape == (n_kv, rows, hd) and a.dtype == np.float16 and np.all(np.isnan(a))
    assert (c.ring_rows, c.sink_rows) == ((ring, sink_rows) if fmt.shadows else (0, 0))
    # The object and its name make the same cache.
    same = HostCache.empty(fmt, n_kv, max_seq, hd, ring_rows=ring, sink_rows=sink_rows)
    assert [a.tobytes() for a in same.arrays] == _snapshot(c)
    # Every unwritten key reads as NaN through the reader too.
    kr, vr = read_kv_rows(c, max_seq - 1, sink=2, win=8)
    assert kr.shape == vr.shape == (n_kv, max_seq, hd)
    assert np.all(np.isnan(kr)) and np.all(np.isnan(vr))

    slots = HostCache.empty(fmt.name, n_kv, max_seq, hd, ring_rows=ring, sink_rows=sink_rows,
                            nslots=2)
    assert slots.k.shape == (2, n_kv, max_seq, fmt.row_width(hd))
    assert all(a.shape[0] == 2 for a in slots.arrays)
    view = slots.slot(1)
    assert (view.head_dim, view.max_seq, view.n_head_kv) == (hd, max_seq, n_kv)
    assert (view.ring_rows, view.sink_rows) == (c.ring_rows, c.sink_rows)
    view.k[0, 0] = 0  # views write through
    assert np.all(slots.k[1, 0, 0] == 0) and not np.any(slots.k[0, 0, 0] == 0)
    with pytest.raises(ValueError):
        c.slot(0)


# ============================================================== cache appends


@pytest.mark.parametrize("fmt", WRAPPING, ids=str)
def test_wrapping_append_ring_dev_and_slots(rng, fmt) -> None:
    r, seed = rng
    n_kv, max_seq, hd = 2, 20, 32
    cache = HostCache.empty(fmt, n_kv, max_seq, hd)
    k_new, v_new = normal(r, (8, n_kv, hd)), normal(r, (8, n_kv, hd))
    append(k_new, v_new, cache, pos0=15)
    rows = [15, 16, 17, 18, 19, 0, 1, 2]  # (pos0 + t) % max_seq
    for t, s in enumerate(rows):
        assert np.array_equal(cache.k[:, s], fmt.quantize_rows(k_new[t])), f"seed={seed}"
        assert np.array_equal(cache.v[:, s], fmt.quantize_rows(v_new[t])), f"seed={seed}"
        if fmt.exact_elements:
            assert bits_equal(fmt.dequantize_rows(cache.k[:, s]), k_new[t]), f"seed={seed}"
    untouched = sorted(set(range(max_seq)) - set(rows))
    assert np.all(np.isnan(fmt.dequantize_rows(cache.k[:, untouched]))), f"seed={seed}"

    append_dev(k_new[3:], v_new[3:], cache, np.array([45], np.int32))
    assert np.array_equal(cache.k[:, 45 % max_seq], fmt.quantize_rows(k_new[3])), f"seed={seed}"
    assert np.all(np.isnan(fmt.dequantize_rows(cache.k[:, 6]))), f"only row 0 lands, seed={seed}"

    slots = HostCache.empty(fmt, n_kv, max_seq, hd, nslots=3)
    pos = np.array([3, 27, 0], np.int32)
    append_slots(k_new[:3], v_new[:3], slots, pos)
    for u in range(3):
        assert np.array_equal(slots.k[u, :, pos[u] % max_seq], fmt.quantize_rows(k_new[u]))
        assert np.array_equal(slots.v[u, :, pos[u] % max_seq], fmt.quantize_rows(v_new[u]))
    nan_rows = np.isnan(fmt.dequantize_rows(slots.k)).all(-1)
    assert nan_rows.sum() == nan_rows.size - 3 * n_kv, f"seed={seed}"

    with pytest.raises(ValueError):  # two rows of one batch would race for one ring row
        append(normal(r, (21, n_kv, hd)), normal(r, (21, n_kv, hd)), cache, 0)


@pytest.mark.parametrize("geometry", CACHE_GEOMETRIES, ids=lambda g: f"ring{g[0]}-sink{g[1]}")
def test_q4_append_body_window_and_sink(rng, geometry) -> None:
    r, seed = rng
    ring, sink_rows = geometry
    n_kv, max_seq, hd, sink, win = 2, 40, 64, 4, 8
    cache = HostCache.empty("q4", n_kv, max_seq, hd, ring_rows=ring, sink_rows=sink_rows)
    k_new, v_new = normal(r, (6, n_kv, hd)), normal(r, (6, n_kv, hd))
    append(k_new, v_new, cache, pos0=2, sink=sink, win=win)
    sh = cache.shadows
    for t in range(6):
        p = 2 + t
        assert np.array_equal(cache.k[:, p], quantize_rows(k_new[t])), f"seed={seed}"
        assert np.array_equal(cache.v[:, p], quantize_rows(v_new[t])), f"seed={seed}"
        assert np.array_equal(sh["k_win"][:, p % ring], k_new[t].astype(np.float16)), seed
        assert np.array_equal(sh["v_win"][:, p % ring], v_new[t].astype(np.float16)), seed
    assert np.array_equal(sh["k_sink"][:, 2:4], np.swapaxes(k_new[:2], 0, 1).astype(np.float16))
    assert np.array_equal(sh["v_sink"][:, 2:4], np.swapaxes(v_new[:2], 0, 1).astype(np.float16))
    others = [i for i in range(sink_rows) if i not in (2, 3)]
    assert np.all(np.isnan(sh["k_sink"][:, others])), f"seed={seed}"
    assert np.all(cache.k[:, 8:] == 0xFF), f"rows past the batch untouched, seed={seed}"

    # The ring slot is pos % ring_rows, not pos % win.
    big = HostCache.empty("q4", 1, 400, 32, ring_rows=ring, sink_rows=sink_rows)
    row = normal(r, (1, 1, 32))
    w = ring * 3 // 8 + 4  # 100 (ring 256) or 28 (ring 64): <= ring, 270 % w != 270 % ring
    append_dev(row, row, big, np.array([270]), sink=0, win=w)
    assert np.array_equal(big.shadows["k_win"][0, 270 % ring], row[0, 0].astype(np.float16))
    assert np.isnan(big.shadows["k_win"][0]).all(-1).sum() == ring - 1, f"seed={seed}"
    assert np.all(np.isnan(big.shadows["k_win"][0, 270 % w])), f"seed={seed}"

    # win = 0: no window mirror at all; sink = 0: no sink mirror.
    off = HostCache.empty("q4", n_kv, max_seq, hd, ring_rows=ring, sink_rows=sink_rows)
    append(k_new, v_new, off, pos0=0, sink=0, win=0)
    assert all(np.all(np.isnan(a)) for a in off.shadows.values()), f"seed={seed}"

    # The whole sink buffer can be used, not one row more.
    full = HostCache.empty("q4", n_kv, max_seq, hd, ring_rows=ring, sink_rows=sink_rows)
    rows = normal(r, (sink_rows + 2, n_kv, hd))
    append(rows, rows, full, 0, sink=sink_rows, win=0)
    assert np.array_equal(full.shadows["k_sink"], np.swapaxes(rows[:sink_rows], 0, 1)
                          .astype(np.float16)), f"seed={seed}"

    with pytest.raises(IndexError):  # the q4 body does not wrap
        append(k_new, v_new, cache, pos0=max_seq - 3, sink=sink, win=win)
    with pytest.raises(ValueError):
        append(k_new, v_new, cache, pos0=0, sink=sink_rows + 1, win=win)


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_rejected_append_leaves_the_cache_untouched(rng, fmt) -> None:
    r, seed = rng
    n_kv, max_seq, hd = 2, 12, 32
    cache = HostCache.empty(fmt, n_kv, max_seq, hd, ring_rows=16, sink_rows=4)
    k, v = normal(r, (6, n_kv, hd)), normal(r, (6, n_kv, hd))
    append(k[:3], v[:3], cache, 0, sink=2, win=4)
    before = _snapshot(cache)
    bad: list[tuple[type[Exception], dict]] = [
        (ValueError, dict(positions=np.array([-1, 0]))),
        (ValueError, dict(positions=np.arange(2), k_new=k[3:5, :1])),  # k/v shapes differ
    ]
    if fmt.append_wraps:
        big = normal(r, (max_seq + 1, n_kv, hd))
        bad.append((ValueError, dict(positions=np.arange(max_seq + 1), k_new=big, v_new=big)))
    else:
        bad.append((IndexError, dict(positions=np.arange(max_seq - 2, max_seq + 1))))
    if fmt.shadows:
        bad.append((ValueError, dict(positions=np.arange(3), sink=5)))
    for exc, kw in bad:
        # Rows other than the ones appended, so any stray write shows.
        args = dict(k_new=k[3:3 + len(kw["positions"])], v_new=v[3:3 + len(kw["positions"])],
                    sink=2, win=4) | kw
        with pytest.raises(exc):
            append_rows(args["k_new"], args["v_new"], cache, args["positions"], args["sink"],
                        args["win"])
        assert _snapshot(cache) == before, f"{exc.__name__} {sorted(kw)} wrote, seed={seed}"


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_append_rows_at_scattered_positions(rng, fmt) -> None:
    r, seed = rng
    n_kv, max_seq, hd = 2, 30, 32
    k, v = normal(r, (4, n_kv, hd)), normal(r, (4, n_kv, hd))
    positions = np.array([9, 2, 14, 3])  # unordered, within one ring span (no slot race)
    a = HostCache.empty(fmt, n_kv, max_seq, hd, ring_rows=16, sink_rows=4)
    b = HostCache.empty(fmt, n_kv, max_seq, hd, ring_rows=16, sink_rows=4)
    append_rows(k, v, a, positions, sink=4, win=8)
    for t, p in enumerate(positions):
        append(k[t:t + 1], v[t:t + 1], b, int(p), sink=4, win=8)
    assert _snapshot(a) == _snapshot(b), f"seed={seed}"


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_slots_append_matches_single_user(rng, fmt) -> None:
    r, seed = rng
    n_kv, max_seq, hd, ring, sink_rows = 2, 300, 32, 64, 8
    slots = HostCache.empty(fmt, n_kv, max_seq, hd, ring_rows=ring, sink_rows=sink_rows,
                            nslots=3)
    k_new, v_new = normal(r, (3, n_kv, hd)), normal(r, (3, n_kv, hd))
    pos = np.array([1, 260, 17])
    append_slots(k_new, v_new, slots, pos, sink=4, win=32)
    for u in range(3):
        single = HostCache.empty(fmt, n_kv, max_seq, hd, ring_rows=ring, sink_rows=sink_rows)
        append(k_new[u:u + 1], v_new[u:u + 1], single, int(pos[u]), sink=4, win=32)
        view = slots.slot(u)
        assert np.array_equal(view.k, single.k, equal_nan=fmt.dtype != "uint8"), f"seed={seed}"
        assert np.array_equal(view.v, single.v, equal_nan=fmt.dtype != "uint8"), f"seed={seed}"
        assert list(view.shadows) == list(single.shadows)
        for name, a in view.shadows.items():
            assert np.array_equal(a, single.shadows[name], equal_nan=True), \
                f"{name} slot {u}, seed={seed}"


def _truth_rows(fmt, x: np.ndarray, cur_pos: int, sink: int, win: int,
                floor: int | None = None) -> np.ndarray:
    """What a reader at ``cur_pos`` must see if every row is the row *of that position*:
    its fp16 value where :func:`shadow_source` picks a shadow, else its body decode.
    ``x`` is ``[positions][n_head_kv][hd]``; returns ``[n_head_kv][cur_pos + 1][hd]``."""
    xs = np.swapaxes(x[:cur_pos + 1], 0, 1)
    body = fmt.dequantize_rows(fmt.quantize_rows(xs))
    if not fmt.shadows:
        return body
    src = shadow_source(np.arange(cur_pos + 1), cur_pos, sink, win, floor)
    return np.where((src != SRC_BODY)[None, :, None], _f16(xs), body)


@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("ring", [RING_ROWS, 64])
def test_fill_equals_token_by_token_appends(rng, fmt, ring) -> None:
    """fill (race-free history batches, then the batch) leaves the cache a decode
    loop of single-row appends leaves, and a decode read sees every position's own row."""
    r, seed = rng
    n_kv, hd, sink, win = 2, 32, 4, ring // 2
    max_seq = 3 * ring
    # (history only; history + a short batch; a batch of a whole ring; a batch that laps
    # the ring twice, where only its newest ring_rows rows may stay in the ring)
    for pos0, upto in ((2 * ring + 5, 2 * ring + 5), (ring + 3, ring + 20), (7, 7 + ring),
                       (5, 2 * ring + 13)):
        x = normal(r, (upto, n_kv, hd))
        y = normal(r, (upto, n_kv, hd))
        a = HostCache.empty(fmt, n_kv, max_seq, hd, ring_rows=ring, sink_rows=SINK_ROWS)
        b = HostCache.empty(fmt, n_kv, max_seq, hd, ring_rows=ring, sink_rows=SINK_ROWS)
        fill(a, x, y, pos0, upto, sink, win)
        for p in range(upto):
            append_dev(x[p:p + 1], y[p:p + 1], b, np.array([p]), sink, win)
        msg = f"pos0={pos0} upto={upto} seed={seed}"
        assert _snapshot(a) == _snapshot(b), msg
        kr, vr = read_kv_rows(a, upto - 1, sink, win)
        assert bits_equal(kr, _truth_rows(fmt, x, upto - 1, sink, win)), msg
        assert bits_equal(vr, _truth_rows(fmt, y, upto - 1, sink, win)), msg


def _is_fp16(s: int, cur_pos: int, sink: int, win: int) -> bool:
    """Transcription of ``fc_kvq4_is_fp16``: key ``s`` comes from a shadow (no floor)."""
    return s < sink or (win > 0 and s > cur_pos - win)


def test_shadow_source_hand_cases() -> None:
    kp = np.arange(41)
    src = shadow_source(kp, cur_pos=40, sink=4, win=8)
    assert np.all(src[:4] == SRC_SINK)
    assert np.all(src[4:33] == SRC_BODY)
    assert np.all(src[33:] == SRC_WINDOW)  # kp > 40 - 8
    floored = shadow_source(kp, cur_pos=40, sink=4, win=8, win_live_lo=35)
    assert np.all(floored[33:36] == SRC_BODY) and np.all(floored[36:] == SRC_WINDOW)
    assert np.all(floored[:4] == SRC_SINK), "the floor never hides the sink"
    assert np.all(shadow_source(kp, 40, sink=0, win=0) == SRC_BODY)
    for s in range(41):
        assert _is_fp16(s, 40, 4, 8) == (src[s] != SRC_BODY)
        assert shadow_source(s, 40, 4, 8) == src[s]  # scalar key


@pytest.mark.parametrize("fmt", [f for f in FMTS if not f.shadows], ids=str)
def test_unshadowed_formats_read_the_body_whatever_sink_and_win(rng, fmt) -> None:
    r, seed = rng
    n_kv, hd = 2, 32
    x, y = normal(r, (40, n_kv, hd)), normal(r, (40, n_kv, hd))
    cache = HostCache.empty(fmt, n_kv, 64, hd)
    append(x, y, cache, 0, sink=4, win=8)  # sink/win are no-ops without shadows
    assert cache.shadows == {} and len(cache.arrays) == 2
    plain = read_kv_rows(cache, 39)
    for sink, win, floor in ((4, 8, None), (4, 8, 30), (0, 16, None)):
        kr, vr = read_kv_rows(cache, 39, sink, win, win_live_lo=floor)
        assert bits_equal(kr, plain[0]) and bits_equal(vr, plain[1]), f"seed={seed}"
    assert bits_equal(plain[0], fmt.dequantize_rows(fmt.quantize_rows(np.swapaxes(x, 0, 1))))


@pytest.mark.parametrize("ring", [RING_ROWS, 64])
def test_q4_ring_laps_and_live_floor_falls_back(rng, ring) -> None:
    """A batch longer than ring_rows - win overwrites ring slots that its own early
    rows still need; the prefill live floor sends those keys to the q4 body."""
    r, seed = rng
    n_kv, hd, sink = 2, 64, 4
    win = ring // 4                      # 64 (ring 256) or 16 (ring 64)
    pos0, n = ring * 100 // 256, ring - 6  # 100, 250 or 25, 58: n > ring - win
    cache = HostCache.empty("q4", n_kv, 512, hd, ring_rows=ring, sink_rows=SINK_ROWS)
    k_all, v_all = normal(r, (pos0 + n, n_kv, hd)), normal(r, (pos0 + n, n_kv, hd))
    fill(cache, k_all, v_all, pos0, pos0 + n, sink, win)
    # fill is the history then the whole batch at once.
    manual = HostCache.empty("q4", n_kv, 512, hd, ring_rows=ring, sink_rows=SINK_ROWS)
    append(k_all[:pos0], v_all[:pos0], manual, 0, sink, win)
    append(k_all[pos0:], v_all[pos0:], manual, pos0, sink, win)
    assert _snapshot(cache) == _snapshot(manual), f"seed={seed}"

    floor = prefill_live_floor(pos0, n, ring)
    assert floor == pos0 + n - 1 - ring
    if ring == RING_ROWS:
        assert floor == 93
    k_win = cache.shadows["k_win"]
    # Keys (pos0 - win, floor] are in the window of query pos0, but their ring slots
    # now hold the positions one ring later; keys (floor, pos0] still hold themselves.
    dead = np.arange(max(pos0 - win + 1, sink), floor + 1)
    live = np.arange(floor + 1, pos0 + 1)
    assert dead.size > 0 and live.size > 0
    msg = f"ring={ring} seed={seed}"
    assert np.array_equal(k_win[:, dead % ring], np.swapaxes(k_all[dead + ring], 0, 1)
                          .astype(np.float16)), msg
    assert np.array_equal(k_win[:, live % ring], np.swapaxes(k_all[live], 0, 1)
                          .astype(np.float16)), msg

    cur = pos0  # first query of the batch
    k_floor, _ = read_kv_rows(cache, cur, sink, win, win_live_lo=floor)
    k_raw, _ = read_kv_rows(cache, cur, sink, win)
    body_dead = np.swapaxes(dequantize_rows(quantize_rows(k_all[dead])), 0, 1)
    assert bits_equal(k_floor[:, dead], body_dead), f"floor falls back to q4, {msg}"
    assert bits_equal(k_raw[:, dead], _f16(np.swapaxes(k_all[dead + ring], 0, 1))), \
        f"acausal read, {msg}"
    assert bits_equal(k_floor[:, live], _f16(np.swapaxes(k_all[live], 0, 1))), f"live, {msg}"
    assert bits_equal(k_floor[:, :sink], _f16(np.swapaxes(k_all[:sink], 0, 1))), f"sink, {msg}"
    # With the floor, every query of the batch reads each key's own row.
    for c in range(pos0, pos0 + n):
        kf, vf = read_kv_rows(cache, c, sink, win, win_live_lo=floor)
        assert bits_equal(kf, _truth_rows(Q4, k_all, c, sink, win, floor)), f"cur={c} {msg}"
        assert bits_equal(vf, _truth_rows(Q4, v_all, c, sink, win, floor)), f"cur={c} {msg}"

    # Causality: with the floor, query 0 of the batch ignores every row appended after
    # it; without the floor, it reads them.
    q = normal(r, (4, n_kv * 2, hd))
    scale = 1 / math.sqrt(hd)

    def run(c: HostCache, lf: int | None) -> np.ndarray:
        return prefill_attention_cache(q, c, 2, pos0, sink, win, 0, 0, scale, live_floor=lf)

    out, out_raw = run(cache, floor), run(cache, None)
    future = k_all.copy()
    future[pos0 + 1:] = normal(r, (n - 1, n_kv, hd), 5.0)
    cache2 = HostCache.empty("q4", n_kv, 512, hd, ring_rows=ring, sink_rows=SINK_ROWS)
    fill(cache2, future, v_all, pos0, pos0 + n, sink, win)
    out2, out2_raw = run(cache2, floor), run(cache2, None)
    assert np.array_equal(out[0], out2[0]), f"floored query 0 saw the future, {msg}"
    assert not np.allclose(out_raw[0], out2_raw[0]), f"unfloored read is acausal, {msg}"


# ============================================================== attention


def test_qz_split(rng) -> None:
    r, seed = rng
    hd = 32
    qg = normal(r, (3, 4, 2 * hd))
    q, z = qz_split(qg, hd)
    assert q.shape == z.shape == (3, 4, hd)
    assert np.array_equal(q, qg[..., :hd]) and np.array_equal(z, qg[..., hd:]), f"seed={seed}"
    fq, fz = qz_split(qg.reshape(-1), hd)
    for i in r.integers(0, fq.size, 20):  # per-element rule of the kernel
        src = (i // hd) * 2 * hd + i % hd
        assert fq[i] == qg.reshape(-1)[src] and fz[i] == qg.reshape(-1)[src + hd], seed


def test_keys_scored_per_tile() -> None:
    hds = (64, 128, 256, 512)
    assert [keys_scored_per_tile(h) for h in hds] == [4, 8, 16, 16]
    assert [keys_scored_per_tile(h, tile=8) for h in hds] == [4, 8, 8, 8]
    assert [keys_scored_per_tile(h, tile=32) for h in hds] == [4, 8, 16, 32]
    assert [keys_scored_per_tile(h, lanes=8) for h in hds] == [8, 16, 16, 16]


# Hand case: cur_pos 40, attn_sink 2, attn_win 4 -> nominal keys {0, 1, 37..40}.
WINDOW_HAND_MASKS = {
    8: list(range(8)) + list(range(32, 41)),     # [0,8) sink, [32,40) [40,41) window
    16: list(range(16)) + list(range(32, 41)),   # [0,16) sink, [32,41) window
    32: list(range(41)),                         # [0,32) sink, [32,41) window: every key
}


@pytest.mark.parametrize("tile", TILES)
def test_window_keeps_whole_tiles_not_keys(tile) -> None:
    cur_pos, sink, win = 40, 2, 4
    nominal = nominal_window_keys(cur_pos, 41, sink, win)
    assert np.flatnonzero(nominal).tolist() == [0, 1, 37, 38, 39, 40]
    mask = attended_keys(cur_pos, 41, sink, win, tile)
    assert np.flatnonzero(mask).tolist() == WINDOW_HAND_MASKS[tile]
    assert mask[5] and not nominal[5]  # outside the documented set, still attended
    assert mask[33] and not nominal[33]
    assert mask[20] == (tile == 32)
    assert tile_in_window(32, 9, cur_pos, sink, win) and not tile_in_window(16, 16, 40, 2, 4)
    assert np.all(attended_keys(cur_pos, 41, sink, 0, tile)), "attn_win <= 0 attends everything"


@pytest.mark.parametrize("tile", TILES)
def test_attended_keys_random_properties(rng, tile) -> None:
    r, seed = rng
    for _ in range(200):
        seq_len = int(r.integers(1, 300))
        cur_pos = seq_len - 1
        sink, win = int(r.integers(0, 20)), int(r.integers(-2, 80))
        mask = attended_keys(cur_pos, seq_len, sink, win, tile)
        nominal = nominal_window_keys(cur_pos, seq_len, sink, win)
        msg = f"tile={tile} seq_len={seq_len} sink={sink} win={win} seed={seed}"
        assert np.all(mask[nominal]), msg
        brute = np.zeros(seq_len, bool)
        for j0 in range(0, seq_len, tile):
            brute[j0:j0 + tile] = nominal[j0:j0 + tile].any()
        assert np.array_equal(mask, brute), msg
        # Decode splits (multiples of the tile) see exactly the prefill tiles.
        n_splits, split_len = decode_plan(seq_len, int(r.integers(1, 64)), int(r.integers(1, 9)),
                                          tile)
        union = np.zeros(seq_len, bool)
        for s in range(n_splits):
            part = attended_keys(cur_pos, split_bounds(s, split_len, seq_len), sink, win, tile)
            union[:part.size] |= part  # a split's mask ends at its k_hi
        assert np.array_equal(union, mask), msg


def test_tiles_start_at_the_split_start() -> None:
    # A split starting off the tile grid (a plan the formula never makes) tiles from k_lo.
    mask = attended_keys(40, (8, 41), attn_sink=0, attn_win=4)
    assert np.flatnonzero(mask).tolist() == list(range(24, 41))  # tiles [8,24) [24,40) [40,41)
    assert not attended_keys(40, (8, 41), 0, 4)[:8].any()
    # tile 8 from k_lo 4: [4,12) ... [28,36) skipped, [36,41) kept.
    mask8 = attended_keys(40, (4, 41), 0, 4, tile=8)
    assert np.flatnonzero(mask8).tolist() == list(range(36, 41))


def _plan_brute(seq_len: int, kps: int, cap: int, tile: int = 16) -> tuple[int, int]:
    n = min(max(math.ceil(seq_len / kps), 1), cap)
    split_len = tile * math.ceil(math.ceil(seq_len / n) / tile)
    return math.ceil(seq_len / split_len), split_len


PLAN_HAND_VALUES = {  # (seq_len, kps, cap) -> (n_splits, split_len)
    8: {(1, 256, 8): (1, 8), (1000, 256, 8): (4, 256), (5000, 256, 8): (8, 632),
        (17, 4, 16): (3, 8)},
    16: {(1, 256, 8): (1, 16), (1000, 256, 8): (4, 256), (5000, 256, 8): (8, 640),
         (17, 4, 16): (2, 16)},  # round-up to 16 leaves fewer splits than n
    32: {(1, 256, 8): (1, 32), (1000, 256, 8): (4, 256), (5000, 256, 8): (8, 640),
         (17, 4, 16): (1, 32)},
}


@pytest.mark.parametrize("tile", TILES)
def test_decode_plan_hand_values_and_properties(rng, tile) -> None:
    r, seed = rng
    for args, want in PLAN_HAND_VALUES[tile].items():
        assert decode_plan(*args, tile=tile) == want, (tile, args)
    if tile == 16:
        assert decode_plan(1000, 256, 8) == (4, 256), "the default tile is 16"
    configs = [(256, 8), (64, 16), (1, 1), (7, 3)] + [
        (int(r.integers(1, 500)), int(r.integers(1, 40))) for _ in range(4)]
    for kps, cap in configs:
        for seq_len in range(1, 2049):
            n_splits, split_len = decode_plan(seq_len, kps, cap, tile)
            msg = f"tile={tile} seq_len={seq_len} kps={kps} cap={cap} seed={seed}"
            assert (n_splits, split_len) == _plan_brute(seq_len, kps, cap, tile), msg
            assert split_len % tile == 0 and split_len > 0, msg
            assert n_splits * split_len >= seq_len, msg
            assert (n_splits - 1) * split_len < seq_len, msg  # no split is past the end
            assert 1 <= n_splits <= cap, msg
    with pytest.raises(ValueError):
        decode_plan(0, 256, 8, tile)


def _direct_decode(q, k_rows, v_rows, kv_groups, mask, scale) -> np.ndarray:
    out = np.empty(q.shape, np.float64)
    for qh in range(q.shape[0]):
        kvh = qh // kv_groups
        nk = mask.size  # rows past the mask may hold NaN poison
        out[qh] = _direct_attention(q[qh], k_rows[kvh][:nk][mask], v_rows[kvh][:nk][mask], scale)
    return out


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("window", [(0, 0), (4, 40), (0, 16), (3, 1)])
def test_decode_partials_and_combine_equal_direct(rng, window, tile) -> None:
    r, seed = rng
    attn_sink, attn_win = window
    n_kv, groups, hd, max_seq = 2, 3, 64, 400
    seq_len = int(r.integers(100, max_seq))
    cache = HostCache.empty("f32", n_kv, max_seq, hd)
    k_cache, v_cache = cache.k, cache.v
    k_cache[:, :seq_len] = normal(r, (n_kv, seq_len, hd), 2.0)
    v_cache[:, :seq_len] = normal(r, (n_kv, seq_len, hd))
    q = normal(r, (n_kv * groups, hd), 2.0)
    scale = 1 / math.sqrt(hd)
    kps, cap = int(r.integers(16, 80)), int(r.integers(2, 9))
    n_splits, split_len = decode_plan(seq_len, kps, cap, tile)
    m, lsum, acc = decode_partials(q, k_cache, v_cache, groups, seq_len, n_splits, split_len,
                                   attn_sink, attn_win, scale, tile=tile)
    msg = f"tile={tile} seq_len={seq_len} kps={kps} cap={cap} window={window} seed={seed}"
    assert m.shape == lsum.shape == (n_kv * groups * n_splits,) and acc.size == m.size * hd, msg
    mask = attended_keys(seq_len - 1, seq_len, attn_sink, attn_win, tile)
    want = _direct_decode(q, k_cache, v_cache, groups, mask, scale)
    np.testing.assert_allclose(combine(m, lsum, acc, n_splits), want, rtol=RTOL, atol=ATOL,
                               err_msg=msg)
    np.testing.assert_allclose(
        decode_attention(q, k_cache, v_cache, groups, seq_len, kps, cap, attn_sink, attn_win,
                         scale, tile=tile), want, rtol=RTOL, atol=ATOL, err_msg=msg)
    # Layout and meaning of one partial: m[qh*n_splits+s], acc[(qh*n_splits+s)*hd + d].
    qh, s = int(r.integers(0, n_kv * groups)), int(r.integers(0, n_splits))
    k_lo, k_hi = split_bounds(s, split_len, seq_len)
    keys = np.flatnonzero(mask[k_lo:k_hi]) + k_lo
    i = qh * n_splits + s
    if keys.size == 0:
        assert m[i] == -np.inf and lsum[i] == 0 and not acc[i * hd:(i + 1) * hd].any(), msg
    else:
        sc = k_cache[qh // groups, keys].astype(np.float64) @ q[qh].astype(np.float64)
        sc *= float(np.float32(scale))
        p = np.exp(sc - sc.max())
        np.testing.assert_allclose(m[i], sc.max(), rtol=RTOL, atol=ATOL, err_msg=msg)
        np.testing.assert_allclose(lsum[i], p.sum(), rtol=RTOL, atol=ATOL, err_msg=msg)
        np.testing.assert_allclose(acc[i * hd:(i + 1) * hd], p @ v_cache[qh // groups, keys],
                                   rtol=RTOL, atol=ATOL, err_msg=msg)


@pytest.mark.parametrize("tile", TILES)
def test_split_with_every_tile_skipped_is_empty(rng, tile) -> None:
    r, seed = rng
    n_kv, groups, hd, seq_len = 1, 2, 32, 200
    k, v = normal(r, (n_kv, seq_len, hd)), normal(r, (n_kv, seq_len, hd))
    q = normal(r, (groups, hd))
    n_splits, split_len = decode_plan(seq_len, 32, 8, tile)
    assert (n_splits, split_len) == (7, 32)  # 29 rounds up to 32 for every tile here
    m, lsum, acc = decode_partials(q, k, v, groups, seq_len, n_splits, split_len, 0, 16, 0.3,
                                   tile=tile)
    m2, l2 = m.reshape(groups, n_splits), lsum.reshape(groups, n_splits)
    acc2 = acc.reshape(groups, n_splits, hd)
    msg = f"tile={tile} seed={seed}"
    # Window [184, 199] lives in split 5 ([160,192)) and split 6 ([192,200)).
    assert np.all(m2[:, :5] == -np.inf) and np.all(l2[:, :5] == 0), msg
    assert not acc2[:, :5].any(), msg
    assert np.all(np.isfinite(m2[:, 5:])) and np.all(l2[:, 5:] > 0), msg
    mask = attended_keys(seq_len - 1, seq_len, 0, 16, tile)
    np.testing.assert_allclose(combine(m, lsum, acc, n_splits),
                               _direct_decode(q, k, v, groups, mask, 0.3),
                               rtol=RTOL, atol=ATOL, err_msg=msg)


def test_combine_treats_empty_partials_as_exact_zeros(rng) -> None:
    r, seed = rng
    heads, n_splits, hd = 3, 4, 16
    m = r.standard_normal((heads, n_splits))
    lsum = r.uniform(0.5, 3.0, (heads, n_splits))
    acc = r.standard_normal((heads, n_splits, hd))
    base = combine(m.ravel(), lsum.ravel(), acc.ravel(), n_splits)
    w = np.exp(m - m.max(1, keepdims=True))
    want = (acc * w[..., None]).sum(1) / (lsum * w).sum(1)[:, None]
    np.testing.assert_allclose(base, want, rtol=1e-13, atol=ATOL, err_msg=f"seed={seed}")
    pad = 3  # off-plan splits of the slots kernels
    m_p = np.concatenate([m, np.full((heads, pad), -np.inf)], 1)
    l_p = np.concatenate([lsum, np.zeros((heads, pad))], 1)
    acc_p = np.concatenate([acc, np.zeros((heads, pad, hd))], 1)
    padded = combine(m_p.ravel(), l_p.ravel(), acc_p.ravel(), n_splits + pad)
    np.testing.assert_allclose(padded, base, rtol=1e-15, atol=0, err_msg=f"seed={seed}")


def test_max_groups_bounds_kv_groups(rng) -> None:
    r, seed = rng
    n_kv, groups, hd, seq_len = 1, 12, 32, 50
    k, v = normal(r, (n_kv, seq_len, hd)), normal(r, (n_kv, seq_len, hd))
    q = normal(r, (n_kv * groups, hd))
    with pytest.raises(ValueError):  # the default bound is the spec's 8
        decode_attention(q, k, v, groups, seq_len, 16, 4, 0, 0, 0.2)
    with pytest.raises(ValueError):
        prefill_attention(q[None], k, v, groups, seq_len - 1, 0, 0, 0.2)
    got = decode_attention(q, k, v, groups, seq_len, 16, 4, 0, 0, 0.2, max_groups=16)
    want = _direct_decode(q, k, v, groups, np.ones(seq_len, bool), 0.2)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")
    pre = prefill_attention(q[None], k, v, groups, seq_len - 1, 0, 0, 0.2, max_groups=16)
    np.testing.assert_allclose(pre[0], want, rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")


def _causal_softmax(q, k, v, kv_groups, pos0, scale) -> np.ndarray:
    """The obvious causal GQA attention: full score matrix, -inf above the diagonal."""
    n, n_head, hd = q.shape
    total = pos0 + n
    out = np.empty((n, n_head, hd))
    allowed = np.tril(np.ones((total, total), bool))[pos0:]  # query row t sees keys <= pos0+t
    for h in range(n_head):
        kk = k[h // kv_groups, :total].astype(np.float64)
        vv = v[h // kv_groups, :total].astype(np.float64)
        s = q[:, h].astype(np.float64) @ kk.T * float(np.float32(scale))
        s = np.where(allowed, s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, h] = (p / p.sum(1, keepdims=True)) @ vv
    return out


@pytest.mark.parametrize("tile", TILES)
def test_prefill_without_window_is_causal_softmax(rng, tile) -> None:
    r, seed = rng
    n_kv, groups, hd, max_seq = 2, 4, 64, 128
    pos0, n = int(r.integers(0, 40)), int(r.integers(1, 60))
    cache = HostCache.empty("f32", n_kv, max_seq, hd)
    k_cache, v_cache = cache.k, cache.v
    k_cache[:, :pos0 + n] = normal(r, (n_kv, pos0 + n, hd), 2.0)
    v_cache[:, :pos0 + n] = normal(r, (n_kv, pos0 + n, hd))
    q = normal(r, (n, n_kv * groups, hd), 2.0)
    scale = 1 / math.sqrt(hd)
    got = prefill_attention(q, k_cache, v_cache, groups, pos0, 0, 0, scale, tile=tile)
    want = _causal_softmax(q, k_cache, v_cache, groups, pos0, scale)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                               err_msg=f"tile={tile} pos0={pos0} n={n} seed={seed}")


@pytest.mark.parametrize("tile", TILES)
def test_prefill_window_uses_tile_mask_and_matches_decode(rng, tile) -> None:
    r, seed = rng
    n_kv, groups, hd, max_seq = 1, 2, 32, 200
    pos0, n, sink, win = 60, 70, 3, 20
    k_cache = normal(r, (n_kv, max_seq, hd), 2.0)
    v_cache = normal(r, (n_kv, max_seq, hd))
    q = normal(r, (n, groups, hd), 2.0)
    scale = 0.2
    got = prefill_attention(q, k_cache, v_cache, groups, pos0, sink, win, scale, tile=tile)
    for t in (0, 13, n - 1):
        cur = pos0 + t
        msg = f"tile={tile} t={t} seed={seed}"
        mask = attended_keys(cur, cur + 1, sink, win, tile)
        want = _direct_decode(q[t], k_cache, v_cache, groups, mask, scale)
        np.testing.assert_allclose(got[t], want, rtol=RTOL, atol=ATOL, err_msg=msg)
        nominal = nominal_window_keys(cur, cur + 1, sink, win)
        per_key = _direct_decode(q[t], k_cache, v_cache, groups, nominal, scale)
        assert not np.allclose(got[t], per_key), f"tile mask must differ here, {msg}"
    dec = decode_attention(q[-1], k_cache, v_cache, groups, pos0 + n, 16, 8, sink, win, scale,
                           tile=tile)
    np.testing.assert_allclose(dec, got[-1], rtol=RTOL, atol=ATOL,
                               err_msg=f"tile={tile} seed={seed}")


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_cache_prefill_and_decode_read_the_rows_the_kernel_sees(rng, fmt) -> None:
    r, seed = rng
    n_kv, groups, hd, max_seq = 2, 2, 64, 160
    n, scale = 100, 1 / 8
    k = normal(r, (n, n_kv, hd), 2.0)
    v = normal(r, (n, n_kv, hd))
    q = normal(r, (n, n_kv * groups, hd), 2.0)
    msg = f"fmt={fmt} seed={seed}"

    def new() -> HostCache:
        return HostCache.empty(fmt, n_kv, max_seq, hd, ring_rows=RING_ROWS, sink_rows=SINK_ROWS)

    # No shadows: every row is the format's decode of its own body row.
    plain = new()
    append(k, v, plain, 0, sink=0, win=0)
    k_deq = fmt.dequantize_rows(fmt.quantize_rows(np.swapaxes(k, 0, 1)))
    v_deq = fmt.dequantize_rows(fmt.quantize_rows(np.swapaxes(v, 0, 1)))
    want_plain = prefill_attention(q, k_deq, v_deq, groups, 0, 0, 0, scale)
    np.testing.assert_allclose(prefill_attention_cache(q, plain, groups, 0, 0, 0, 0, 0, scale),
                               want_plain, rtol=RTOL, atol=ATOL, err_msg=msg)
    # k_round narrows K as a staged fp16 K tile does; V is untouched.
    np.testing.assert_allclose(
        prefill_attention_cache(q, plain, groups, 0, 0, 0, 0, 0, scale, k_round=_f16),
        prefill_attention(q, _f16(k_deq), v_deq, groups, 0, 0, 0, scale),
        rtol=RTOL, atol=ATOL, err_msg=msg)

    floor = prefill_live_floor(0, n, RING_ROWS)
    if not fmt.shadows:
        # sink / win / the floor change nothing without shadows.
        shadowed_args = new()
        append(k, v, shadowed_args, 0, sink=4, win=24)
        np.testing.assert_allclose(
            prefill_attention_cache(q, shadowed_args, groups, 0, 4, 24, 0, 0, scale, floor),
            want_plain, rtol=RTOL, atol=ATOL, err_msg=msg)
        return

    # A window wider than the batch: every key is read from fp16.
    wide = new()
    append(k, v, wide, 0, sink=4, win=128)
    k16 = _f16(np.swapaxes(k, 0, 1))
    v16 = _f16(np.swapaxes(v, 0, 1))
    np.testing.assert_allclose(
        prefill_attention_cache(q, wide, groups, 0, 4, 128, 0, 0, scale, floor),
        prefill_attention(q, k16, v16, groups, 0, 0, 0, scale),
        rtol=RTOL, atol=ATOL, err_msg=msg)

    # Mixed sink / body / window rows, and decode agrees with the last prefill row.
    mixed = new()
    append(k, v, mixed, 0, sink=4, win=24)
    kr, vr = read_kv_rows(mixed, n - 1, 4, 24)
    assert bits_equal(kr[:, 10], k_deq[:, 10]) and bits_equal(kr[:, 90], k16[:, 90]), msg
    assert bits_equal(vr[:, 1], v16[:, 1]), msg
    for tile in TILES:
        pre = prefill_attention_cache(q, mixed, groups, 0, 4, 24, 2, 50, scale, floor, tile=tile)
        dec = decode_attention(q[-1], kr, vr, groups, n, 32, 4, 2, 50, scale, tile=tile)
        np.testing.assert_allclose(dec, pre[-1], rtol=RTOL, atol=ATOL, err_msg=f"{tile} {msg}")


@pytest.mark.parametrize("tile", TILES)
def test_slots_partials_layout_and_attention(rng, tile) -> None:
    r, seed = rng
    nslots, n_kv, groups, hd, max_seq = 3, 2, 2, 32, 300
    pos = np.array([250, 20, 130])
    f32 = HostCache.empty("f32", n_kv, max_seq, hd, nslots=nslots)
    ks, vs = f32.k, f32.v
    for u in range(nslots):
        ks[u, :, :pos[u] + 1] = normal(r, (n_kv, pos[u] + 1, hd))
        vs[u, :, :pos[u] + 1] = normal(r, (n_kv, pos[u] + 1, hd))
    q = normal(r, (nslots, n_kv * groups, hd))
    kps, cap, scale = 32, 6, 0.25
    m, lsum, acc, width = decode_partials_slots(q, ks, vs, pos, groups, kps, cap, 0, 0, scale,
                                                tile=tile)
    n_head = n_kv * groups
    msg = f"tile={tile} seed={seed}"
    assert width == max(decode_plan(int(p) + 1, kps, cap, tile)[0] for p in pos)
    m3 = m.reshape(nslots, n_head, width)
    for u in range(nslots):
        n_splits, split_len = decode_plan(int(pos[u]) + 1, kps, cap, tile)
        mu, lu, accu = decode_partials(q[u], ks[u], vs[u], groups, int(pos[u]) + 1, n_splits,
                                       split_len, 0, 0, scale, tile=tile)
        assert np.array_equal(m3[u, :, :n_splits].ravel(), mu), f"slot {u}, {msg}"
        assert np.array_equal(lsum.reshape(nslots, n_head, width)[u, :, :n_splits].ravel(), lu)
        assert np.array_equal(
            acc.reshape(nslots, n_head, width, hd)[u, :, :n_splits].ravel(), accu)
        assert np.all(m3[u, :, n_splits:] == -np.inf), f"off-plan is empty, {msg}"
    # A wider launch only pads with empty splits.
    m_w, _, _, w2 = decode_partials_slots(q, ks, vs, pos, groups, kps, cap, 0, 0, scale,
                                          launch_splits=width + 2, tile=tile)
    assert w2 == width + 2
    assert np.array_equal(m_w.reshape(nslots, n_head, w2)[..., :width], m3), msg
    assert np.all(m_w.reshape(nslots, n_head, w2)[..., width:] == -np.inf), msg
    with pytest.raises(ValueError):
        decode_partials_slots(q, ks, vs, pos, groups, kps, cap, 0, 0, scale,
                              launch_splits=width - 1, tile=tile)
    out = decode_attention_slots(q, ks, vs, pos, groups, kps, cap, 0, 0, scale, tile=tile)
    for u in range(nslots):
        want = decode_attention(q[u], ks[u], vs[u], groups, int(pos[u]) + 1, kps, cap, 0, 0,
                                scale, tile=tile)
        np.testing.assert_allclose(out[u], want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"slot {u}, {msg}")

    # The q4 slot kernels: rows come from each slot's cache view, here with a 64-row
    # ring, so the history laps it (fill appends it in race-free batches).
    ring, sink, win = 64, 4, 32
    q4 = HostCache.empty("q4", n_kv, max_seq, hd, ring_rows=ring, sink_rows=SINK_ROWS,
                         nslots=nslots)
    for u in range(nslots):
        rows_k = np.swapaxes(ks[u, :, :pos[u] + 1], 0, 1)
        rows_v = np.swapaxes(vs[u, :, :pos[u] + 1], 0, 1)
        fill(q4.slot(u), rows_k, rows_v, int(pos[u]), int(pos[u]) + 1, sink, win)
        kr, vr = read_kv_rows(q4.slot(u), int(pos[u]), sink, win)
        assert bits_equal(kr, _truth_rows(Q4, rows_k, int(pos[u]), sink, win)), f"{u} {msg}"
        assert bits_equal(vr, _truth_rows(Q4, rows_v, int(pos[u]), sink, win)), f"{u} {msg}"

    def rows(u: int) -> tuple[np.ndarray, np.ndarray]:
        return read_kv_rows(q4.slot(u), int(pos[u]), sink, win)

    out_q4 = decode_attention_slots(q, rows, None, pos, groups, kps, cap, 0, 0, scale, tile=tile)
    as_list = decode_attention_slots(q, [rows(u) for u in range(nslots)], None, pos, groups, kps,
                                     cap, 0, 0, scale, tile=tile)
    assert np.array_equal(out_q4, as_list), msg
    for u in range(nslots):
        kr, vr = rows(u)
        mask = np.ones(pos[u] + 1, bool)
        want = _direct_decode(q[u], kr, vr, groups, mask, scale)
        np.testing.assert_allclose(out_q4[u], want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"slot {u}, {msg}")
