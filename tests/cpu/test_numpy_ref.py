"""CPU tests of kgen.numpy_ref, the NumPy reference the GPU kernels are checked against.

Random inputs are fresh on every run; each test records its seed in every
assertion message. Set KGEN_TEST_SEED=<seed> to replay a failure.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from kgen.numpy_ref import (
    SINKMAX,
    SRC_Q4,
    SRC_SINK,
    SRC_WINDOW,
    WMAX,
    Q4Cache,
    attended_keys,
    combine,
    decode_attention,
    decode_attention_slots,
    decode_partials,
    decode_partials_slots,
    decode_plan,
    dequantize_row,
    dequantize_rows,
    empty_f32_cache,
    is_fp16,
    keys_scored_per_tile,
    kv_append,
    kv_append_dev,
    kv_append_q4,
    kv_append_q4_dev,
    kv_append_slots,
    kv_append_slots_q4,
    nominal_window_keys,
    prefill_attention,
    prefill_attention_q4,
    prefill_live_floor,
    quantize_row,
    quantize_rows,
    qz_split,
    read_key_rows_q4,
    read_kv_rows_q4,
    row_bytes,
    shadow_source,
    split_bounds,
    tile_in_window,
)


@pytest.fixture
def rng() -> tuple[np.random.Generator, int]:
    """A generator with a fresh seed (or KGEN_TEST_SEED) and that seed."""
    env = os.environ.get("KGEN_TEST_SEED")
    seed = int(env) if env else int(np.random.SeedSequence().entropy)
    print(f"KGEN_TEST_SEED={seed}")
    return np.random.default_rng(seed), seed


def _normal(r: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (r.standard_normal(shape) * scale).astype(np.float32)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as float32 bit patterns, except any NaN matches any NaN."""
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    na, nb = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(na, nb)
                and np.array_equal(a.view(np.uint32)[~na], b.view(np.uint32)[~nb]))


# Outputs are convex combinations of V rows (|v| ~ 1); a component that cancels to
# ~1e-5 cannot keep 1e-12 relative accuracy, hence a small absolute floor too.
RTOL, ATOL = 1e-12, 1e-13


def _direct_attention(qv: np.ndarray, keys: np.ndarray, vals: np.ndarray, scale: float
                      ) -> np.ndarray:
    """Textbook single-pass softmax attention of one query, in float64."""
    s = keys.astype(np.float64) @ qv.astype(np.float64) * float(np.float32(scale))
    p = np.exp(s - s.max())
    return (p @ vals.astype(np.float64)) / p.sum()


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
    assert row_bytes(32) == 18
    assert row_bytes(128) == 72
    assert row_bytes(256) == 144
    with pytest.raises(ValueError):
        row_bytes(48)


def test_hand_block_rounding_clamping_and_nibbles() -> None:
    q = quantize_row(HAND_X)
    assert q.dtype == np.uint8
    assert q.tolist() == HAND_BYTES
    assert dequantize_row(q).tolist() == HAND_DECODED
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
    x = _normal(r, (64, 256), 3.0)
    q = quantize_rows(x).reshape(64, 8, 18)
    assert np.all(q[..., 1] & 0x80), f"every scale must carry the sign bit, seed={seed}"
    blocks = x.reshape(64, 8, 32)
    amax = np.abs(blocks).max(-1)
    d = (q[..., 0].astype(np.uint16) | (q[..., 1].astype(np.uint16) << 8)).view(np.float16)
    np.testing.assert_allclose(d.astype(np.float64), -amax / 8.0, rtol=2.0**-11,
                               err_msg=f"seed={seed}")
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
        x = _normal(r, (32, 256), scale)
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
    rows = [_normal(r, (128,), s) for s in (1e-30, 1e-3, 1.0, 1e4)]
    rows.append(r.integers(-20, 20, 128).astype(np.float32) / np.float32(4.0))  # many ties
    # Arbitrary bit patterns: NaN, inf, subnormals, huge values.
    rows.append(np.frombuffer(r.bytes(4 * 128), dtype=np.float32).copy())
    tiny = _normal(r, (128,), 1.0) * np.float32(2.0**-126)
    rows.append(tiny.astype(np.float32))
    for i, x in enumerate(rows):
        q = quantize_row(x)
        assert q.tolist() == _scalar_quantize(x), f"row {i}, seed={seed}"
        assert _bits_equal(dequantize_row(q), _scalar_dequantize(q)), f"row {i}, seed={seed}"


def test_batched_shapes_match_single_rows(rng) -> None:
    r, seed = rng
    x = _normal(r, (3, 2, 64), 2.0)
    q = quantize_rows(x)
    assert q.shape == (3, 2, 36)
    for i in range(3):
        for h in range(2):
            assert np.array_equal(q[i, h], quantize_row(x[i, h])), f"seed={seed}"
            assert _bits_equal(dequantize_rows(q)[i, h], dequantize_row(q[i, h])), f"seed={seed}"
    with pytest.raises(ValueError):
        quantize_row(x[0])
    with pytest.raises(ValueError):
        dequantize_row(q[0])


# ============================================================== cache appends


def test_f32_append_ring_dev_and_slots(rng) -> None:
    r, seed = rng
    n_kv, max_seq, hd = 2, 20, 16
    k_cache, v_cache = empty_f32_cache(n_kv, max_seq, hd)
    k_new, v_new = _normal(r, (8, n_kv, hd)), _normal(r, (8, n_kv, hd))
    kv_append(k_new, v_new, k_cache, v_cache, pos0=15)
    slots = [15, 16, 17, 18, 19, 0, 1, 2]  # (pos0 + t) % max_seq
    for t, s in enumerate(slots):
        assert np.array_equal(k_cache[:, s], k_new[t]), f"seed={seed}"
        assert np.array_equal(v_cache[:, s], v_new[t]), f"seed={seed}"
    untouched = sorted(set(range(max_seq)) - set(slots))
    assert np.all(np.isnan(k_cache[:, untouched])), f"seed={seed}"

    kv_append_dev(k_new[3:], v_new[3:], k_cache, v_cache, np.array([45], np.int32))
    assert np.array_equal(k_cache[:, 45 % max_seq], k_new[3]), f"seed={seed}"
    assert np.all(np.isnan(k_cache[:, 6])), f"only row 0 lands, seed={seed}"

    ks, vs = empty_f32_cache(n_kv, max_seq, hd, nslots=3)
    pos = np.array([3, 27, 0], np.int32)
    kv_append_slots(k_new[:3], v_new[:3], ks, vs, pos)
    for u in range(3):
        assert np.array_equal(ks[u, :, pos[u] % max_seq], k_new[u]), f"seed={seed}"
        assert np.array_equal(vs[u, :, pos[u] % max_seq], v_new[u]), f"seed={seed}"
    assert np.isnan(ks).sum() == ks.size - 3 * n_kv * hd, f"seed={seed}"

    with pytest.raises(ValueError):
        kv_append(_normal(r, (21, n_kv, hd)), _normal(r, (21, n_kv, hd)), k_cache, v_cache, 0)


def test_q4_append_body_window_and_sink(rng) -> None:
    r, seed = rng
    n_kv, max_seq, hd, sink, win = 2, 40, 64, 4, 8
    cache = Q4Cache.empty(n_kv, max_seq, hd)
    k_new, v_new = _normal(r, (6, n_kv, hd)), _normal(r, (6, n_kv, hd))
    kv_append_q4(k_new, v_new, cache, pos0=2, sink=sink, win=win)
    for t in range(6):
        p = 2 + t
        assert np.array_equal(cache.k[:, p], quantize_rows(k_new[t])), f"seed={seed}"
        assert np.array_equal(cache.v[:, p], quantize_rows(v_new[t])), f"seed={seed}"
        assert np.array_equal(cache.k_win[:, p % WMAX], k_new[t].astype(np.float16)), seed
        assert np.array_equal(cache.v_win[:, p % WMAX], v_new[t].astype(np.float16)), seed
    assert np.array_equal(cache.k_sink[:, 2:4], np.swapaxes(k_new[:2], 0, 1).astype(np.float16))
    assert np.all(np.isnan(cache.k_sink[:, [0, 1, 4, 5, 6, 7]])), f"seed={seed}"
    assert np.all(cache.k[:, 8:] == 0xFF), f"rows past the batch untouched, seed={seed}"

    # The ring slot is pos % WMAX, not pos % win.
    big = Q4Cache.empty(1, 400, 32)
    row = _normal(r, (1, 1, 32))
    kv_append_q4_dev(row, row, big, np.array([270]), sink=0, win=100)
    assert np.array_equal(big.k_win[0, 270 % WMAX], row[0, 0].astype(np.float16)), seed
    assert np.all(np.isnan(big.k_win[0, 270 % 100])), f"seed={seed}"

    # win = 0: no window mirror at all.
    off = Q4Cache.empty(n_kv, max_seq, hd)
    kv_append_q4(k_new, v_new, off, pos0=0, sink=0, win=0)
    assert np.all(np.isnan(off.k_win)) and np.all(np.isnan(off.k_sink)), f"seed={seed}"

    with pytest.raises(IndexError):
        kv_append_q4(k_new, v_new, cache, pos0=max_seq - 3, sink=sink, win=win)
    with pytest.raises(ValueError):
        kv_append_q4(k_new, v_new, cache, pos0=0, sink=SINKMAX + 1, win=win)


def test_q4_slots_append_matches_single_user(rng) -> None:
    r, seed = rng
    n_kv, max_seq, hd = 2, 300, 32
    slots = Q4Cache.empty(n_kv, max_seq, hd, nslots=3)
    k_new, v_new = _normal(r, (3, n_kv, hd)), _normal(r, (3, n_kv, hd))
    pos = np.array([1, 260, 17])
    kv_append_slots_q4(k_new, v_new, slots, pos, sink=4, win=32)
    for u in range(3):
        single = Q4Cache.empty(n_kv, max_seq, hd)
        kv_append_q4(k_new[u:u + 1], v_new[u:u + 1], single, int(pos[u]), sink=4, win=32)
        view = slots.slot(u)
        for name in ("k", "v"):
            assert np.array_equal(getattr(view, name), getattr(single, name)), f"seed={seed}"
        for name in ("k_sink", "v_sink", "k_win", "v_win"):
            a, b = getattr(view, name), getattr(single, name)
            assert np.array_equal(a, b, equal_nan=True), f"{name} slot {u}, seed={seed}"


def test_shadow_source_hand_cases() -> None:
    kp = np.arange(41)
    src = shadow_source(kp, cur_pos=40, sink=4, win=8)
    assert np.all(src[:4] == SRC_SINK)
    assert np.all(src[4:33] == SRC_Q4)
    assert np.all(src[33:] == SRC_WINDOW)  # kp > 40 - 8
    floored = shadow_source(kp, cur_pos=40, sink=4, win=8, win_live_lo=35)
    assert np.all(floored[33:36] == SRC_Q4) and np.all(floored[36:] == SRC_WINDOW)
    assert np.all(shadow_source(kp, 40, sink=0, win=0) == SRC_Q4)
    for s in range(41):
        assert is_fp16(s, 40, 4, 8) == (src[s] != SRC_Q4)


def test_q4_ring_laps_at_wmax_and_live_floor_falls_back(rng) -> None:
    """A batch longer than WMAX - win overwrites ring slots that its own early
    rows still need; the prefill live floor sends those keys to the q4 body."""
    r, seed = rng
    n_kv, hd, sink, win = 2, 64, 4, 64
    pos0, n = 100, 250  # n > WMAX - win = 192
    cache = Q4Cache.empty(n_kv, 512, hd)
    k_all, v_all = _normal(r, (pos0 + n, n_kv, hd)), _normal(r, (pos0 + n, n_kv, hd))
    kv_append_q4(k_all[:pos0], v_all[:pos0], cache, 0, sink, win)
    kv_append_q4(k_all[pos0:], v_all[pos0:], cache, pos0, sink, win)

    floor = prefill_live_floor(pos0, n)
    assert floor == pos0 + n - 1 - WMAX == 93
    # Key 50 is in the window of query 100 but its slot now holds position 306.
    assert np.array_equal(cache.k_win[:, 50 % WMAX], k_all[50 + WMAX].astype(np.float16))
    assert not np.array_equal(cache.k_win[:, 50], k_all[50].astype(np.float16)), f"seed={seed}"

    cur = pos0  # first query of the batch
    k_floor = read_key_rows_q4(cache.k, cache.k_sink, cache.k_win, cur, sink, win,
                               win_live_lo=floor)
    k_raw = read_key_rows_q4(cache.k, cache.k_sink, cache.k_win, cur, sink, win)
    q4_50 = dequantize_rows(quantize_rows(k_all[50]))
    assert _bits_equal(k_floor[:, 50], q4_50), f"floor falls back to q4, seed={seed}"
    assert _bits_equal(k_raw[:, 50], k_all[306].astype(np.float16)), f"acausal read, seed={seed}"
    assert _bits_equal(k_floor[:, 95], k_all[95].astype(np.float16)), f"live slot, seed={seed}"
    assert _bits_equal(k_floor[:, 2], k_all[2].astype(np.float16)), f"sink, seed={seed}"

    # Causality: with the floor, query 0 of the batch ignores rows appended after
    # it; without the floor, it reads them.
    q = _normal(r, (n, n_kv * 2, hd))
    scale = 1 / math.sqrt(hd)
    out = prefill_attention_q4(q, cache, 2, pos0, sink, win, 0, 0, scale)
    out_raw = prefill_attention_q4(q, cache, 2, pos0, sink, win, 0, 0, scale, live_floor=False)
    future = k_all.copy()
    future[300:] = _normal(r, (50, n_kv, hd), 5.0)
    cache2 = Q4Cache.empty(n_kv, 512, hd)
    kv_append_q4(future[:pos0], v_all[:pos0], cache2, 0, sink, win)
    kv_append_q4(future[pos0:], v_all[pos0:], cache2, pos0, sink, win)
    out2 = prefill_attention_q4(q, cache2, 2, pos0, sink, win, 0, 0, scale)
    out2_raw = prefill_attention_q4(q, cache2, 2, pos0, sink, win, 0, 0, scale, live_floor=False)
    assert np.array_equal(out[0], out2[0]), f"floored query 0 saw the future, seed={seed}"
    assert not np.allclose(out_raw[0], out2_raw[0]), f"unfloored read is acausal, seed={seed}"


# ============================================================== attention


def test_qz_split(rng) -> None:
    r, seed = rng
    hd = 32
    qg = _normal(r, (3, 4, 2 * hd))
    q, z = qz_split(qg, hd)
    assert q.shape == z.shape == (3, 4, hd)
    assert np.array_equal(q, qg[..., :hd]) and np.array_equal(z, qg[..., hd:]), f"seed={seed}"
    fq, fz = qz_split(qg.reshape(-1), hd)
    for i in r.integers(0, fq.size, 20):  # per-element rule of the kernel
        src = (i // hd) * 2 * hd + i % hd
        assert fq[i] == qg.reshape(-1)[src] and fz[i] == qg.reshape(-1)[src + hd], seed


def test_keys_scored_per_tile() -> None:
    assert [keys_scored_per_tile(h) for h in (64, 128, 256, 512)] == [4, 8, 16, 16]


def test_window_keeps_whole_tiles_not_keys() -> None:
    cur_pos, sink, win = 40, 2, 4
    nominal = nominal_window_keys(cur_pos, 41, sink, win)
    assert np.flatnonzero(nominal).tolist() == [0, 1, 37, 38, 39, 40]
    mask = attended_keys(cur_pos, 41, sink, win)
    # Tile [0,16) touches the sink, tile [32,41) the window, tile [16,32) neither.
    assert np.flatnonzero(mask).tolist() == list(range(16)) + list(range(32, 41))
    assert mask[5] and not nominal[5]  # outside the documented set, still attended
    assert mask[33] and not nominal[33]
    assert not mask[20]
    assert tile_in_window(32, 9, cur_pos, sink, win) and not tile_in_window(16, 16, 40, 2, 4)
    assert np.all(attended_keys(cur_pos, 41, sink, 0)), "attn_win <= 0 attends everything"


def test_attended_keys_random_properties(rng) -> None:
    r, seed = rng
    for _ in range(200):
        seq_len = int(r.integers(1, 300))
        cur_pos = seq_len - 1
        sink, win = int(r.integers(0, 20)), int(r.integers(-2, 80))
        mask = attended_keys(cur_pos, seq_len, sink, win)
        nominal = nominal_window_keys(cur_pos, seq_len, sink, win)
        msg = f"seq_len={seq_len} sink={sink} win={win} seed={seed}"
        assert np.all(mask[nominal]), msg
        brute = np.zeros(seq_len, bool)
        for j0 in range(0, seq_len, 16):
            brute[j0:j0 + 16] = nominal[j0:j0 + 16].any()
        assert np.array_equal(mask, brute), msg
        # Decode splits (multiples of 16) see exactly the prefill tiles.
        n_splits, split_len = decode_plan(seq_len, int(r.integers(1, 64)), int(r.integers(1, 9)))
        union = np.zeros(seq_len, bool)
        for s in range(n_splits):
            part = attended_keys(cur_pos, split_bounds(s, split_len, seq_len), sink, win)
            union[:part.size] |= part  # a split's mask ends at its k_hi
        assert np.array_equal(union, mask), msg


def test_tiles_start_at_the_split_start() -> None:
    # A split starting off the 16-grid (a plan the formula never makes) tiles from k_lo.
    mask = attended_keys(40, (8, 41), attn_sink=0, attn_win=4)
    assert np.flatnonzero(mask).tolist() == list(range(24, 41))  # tiles [8,24) [24,40) [40,41)
    assert not attended_keys(40, (8, 41), 0, 4)[:8].any()


def _plan_brute(seq_len: int, kps: int, cap: int) -> tuple[int, int]:
    n = min(max(math.ceil(seq_len / kps), 1), cap)
    split_len = 16 * math.ceil(math.ceil(seq_len / n) / 16)
    return math.ceil(seq_len / split_len), split_len


def test_decode_plan_hand_values_and_properties(rng) -> None:
    r, seed = rng
    assert decode_plan(1, 256, 8) == (1, 16)
    assert decode_plan(1000, 256, 8) == (4, 256)
    assert decode_plan(5000, 256, 8) == (8, 640)
    assert decode_plan(17, 4, 16) == (2, 16)  # round-up to 16 leaves fewer splits than n
    configs = [(256, 8), (64, 16), (1, 1), (7, 3)] + [
        (int(r.integers(1, 500)), int(r.integers(1, 40))) for _ in range(4)]
    for kps, cap in configs:
        for seq_len in range(1, 2049):
            n_splits, split_len = decode_plan(seq_len, kps, cap)
            msg = f"seq_len={seq_len} kps={kps} cap={cap} seed={seed}"
            assert (n_splits, split_len) == _plan_brute(seq_len, kps, cap), msg
            assert split_len % 16 == 0 and split_len > 0, msg
            assert n_splits * split_len >= seq_len, msg
            assert (n_splits - 1) * split_len < seq_len, msg  # no split is past the end
            assert 1 <= n_splits <= cap, msg
    with pytest.raises(ValueError):
        decode_plan(0, 256, 8)


def _direct_decode(q, k_rows, v_rows, kv_groups, mask, scale) -> np.ndarray:
    out = np.empty(q.shape, np.float64)
    for qh in range(q.shape[0]):
        kvh = qh // kv_groups
        nk = mask.size  # rows past the mask may hold NaN poison
        out[qh] = _direct_attention(q[qh], k_rows[kvh][:nk][mask], v_rows[kvh][:nk][mask], scale)
    return out


@pytest.mark.parametrize("window", [(0, 0), (4, 40), (0, 16), (3, 1)])
def test_decode_partials_and_combine_equal_direct(rng, window) -> None:
    r, seed = rng
    attn_sink, attn_win = window
    n_kv, groups, hd, max_seq = 2, 3, 64, 400
    seq_len = int(r.integers(100, max_seq))
    k_cache, v_cache = empty_f32_cache(n_kv, max_seq, hd)
    k_cache[:, :seq_len] = _normal(r, (n_kv, seq_len, hd), 2.0)
    v_cache[:, :seq_len] = _normal(r, (n_kv, seq_len, hd))
    q = _normal(r, (n_kv * groups, hd), 2.0)
    scale = 1 / math.sqrt(hd)
    kps, cap = int(r.integers(16, 80)), int(r.integers(2, 9))
    n_splits, split_len = decode_plan(seq_len, kps, cap)
    m, lsum, acc = decode_partials(q, k_cache, v_cache, groups, seq_len, n_splits, split_len,
                                attn_sink, attn_win, scale)
    msg = f"seq_len={seq_len} kps={kps} cap={cap} window={window} seed={seed}"
    assert m.shape == lsum.shape == (n_kv * groups * n_splits,) and acc.size == m.size * hd, msg
    mask = attended_keys(seq_len - 1, seq_len, attn_sink, attn_win)
    want = _direct_decode(q, k_cache, v_cache, groups, mask, scale)
    np.testing.assert_allclose(combine(m, lsum, acc, n_splits), want, rtol=RTOL, atol=ATOL,
                               err_msg=msg)
    np.testing.assert_allclose(
        decode_attention(q, k_cache, v_cache, groups, seq_len, kps, cap, attn_sink, attn_win,
                         scale), want, rtol=RTOL, atol=ATOL, err_msg=msg)
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


def test_split_with_every_tile_skipped_is_empty(rng) -> None:
    r, seed = rng
    n_kv, groups, hd, seq_len = 1, 2, 32, 200
    k, v = _normal(r, (n_kv, seq_len, hd)), _normal(r, (n_kv, seq_len, hd))
    q = _normal(r, (groups, hd))
    n_splits, split_len = decode_plan(seq_len, 32, 8)
    assert (n_splits, split_len) == (7, 32)
    m, lsum, acc = decode_partials(q, k, v, groups, seq_len, n_splits, split_len, 0, 16, 0.3)
    m2, l2 = m.reshape(groups, n_splits), lsum.reshape(groups, n_splits)
    acc2 = acc.reshape(groups, n_splits, hd)
    # Window [184, 199] lives in split 5 ([160,192)) and split 6 ([192,200)).
    assert np.all(m2[:, :5] == -np.inf) and np.all(l2[:, :5] == 0), f"seed={seed}"
    assert not acc2[:, :5].any(), f"seed={seed}"
    assert np.all(np.isfinite(m2[:, 5:])) and np.all(l2[:, 5:] > 0), f"seed={seed}"
    mask = attended_keys(seq_len - 1, seq_len, 0, 16)
    np.testing.assert_allclose(combine(m, lsum, acc, n_splits),
                               _direct_decode(q, k, v, groups, mask, 0.3),
                               rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")


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


def test_prefill_without_window_is_causal_softmax(rng) -> None:
    r, seed = rng
    n_kv, groups, hd, max_seq = 2, 4, 64, 128
    pos0, n = int(r.integers(0, 40)), int(r.integers(1, 60))
    k_cache, v_cache = empty_f32_cache(n_kv, max_seq, hd)
    k_cache[:, :pos0 + n] = _normal(r, (n_kv, pos0 + n, hd), 2.0)
    v_cache[:, :pos0 + n] = _normal(r, (n_kv, pos0 + n, hd))
    q = _normal(r, (n, n_kv * groups, hd), 2.0)
    scale = 1 / math.sqrt(hd)
    got = prefill_attention(q, k_cache, v_cache, groups, pos0, 0, 0, scale)
    want = _causal_softmax(q, k_cache, v_cache, groups, pos0, scale)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                               err_msg=f"pos0={pos0} n={n} seed={seed}")


def test_prefill_window_uses_tile_mask_and_matches_decode(rng) -> None:
    r, seed = rng
    n_kv, groups, hd, max_seq = 1, 2, 32, 200
    pos0, n, sink, win = 60, 70, 3, 20
    k_cache = _normal(r, (n_kv, max_seq, hd), 2.0)
    v_cache = _normal(r, (n_kv, max_seq, hd))
    q = _normal(r, (n, groups, hd), 2.0)
    scale = 0.2
    got = prefill_attention(q, k_cache, v_cache, groups, pos0, sink, win, scale)
    for t in (0, 13, n - 1):
        cur = pos0 + t
        mask = attended_keys(cur, cur + 1, sink, win)
        want = _direct_decode(q[t], k_cache, v_cache, groups, mask, scale)
        np.testing.assert_allclose(got[t], want, rtol=RTOL, atol=ATOL, err_msg=f"t={t} seed={seed}")
        nominal = nominal_window_keys(cur, cur + 1, sink, win)
        per_key = _direct_decode(q[t], k_cache, v_cache, groups, nominal, scale)
        assert not np.allclose(got[t], per_key), f"tile mask must differ here, seed={seed}"
    dec = decode_attention(q[-1], k_cache, v_cache, groups, pos0 + n, 16, 8, sink, win, scale)
    np.testing.assert_allclose(dec, got[-1], rtol=RTOL, atol=ATOL, err_msg=f"seed={seed}")


def test_q4_prefill_and_decode_read_the_rows_the_kernel_sees(rng) -> None:
    r, seed = rng
    n_kv, groups, hd, max_seq = 2, 2, 64, 160
    n, scale = 100, 1 / 8
    k = _normal(r, (n, n_kv, hd), 2.0)
    v = _normal(r, (n, n_kv, hd))
    q = _normal(r, (n, n_kv * groups, hd), 2.0)
    msg = f"seed={seed}"

    # No shadows: every row is the dequantized q4 body.
    plain = Q4Cache.empty(n_kv, max_seq, hd)
    kv_append_q4(k, v, plain, 0, sink=0, win=0)
    k_deq = np.swapaxes(dequantize_rows(quantize_rows(k)), 0, 1)
    v_deq = np.swapaxes(dequantize_rows(quantize_rows(v)), 0, 1)
    np.testing.assert_allclose(
        prefill_attention_q4(q, plain, groups, 0, 0, 0, 0, 0, scale),
        prefill_attention(q, k_deq, v_deq, groups, 0, 0, 0, scale),
        rtol=RTOL, atol=ATOL, err_msg=msg)

    # A window wider than the batch: every key is read from fp16.
    wide = Q4Cache.empty(n_kv, max_seq, hd)
    kv_append_q4(k, v, wide, 0, sink=4, win=128)
    k16 = np.swapaxes(k.astype(np.float16).astype(np.float32), 0, 1)
    v16 = np.swapaxes(v.astype(np.float16).astype(np.float32), 0, 1)
    np.testing.assert_allclose(
        prefill_attention_q4(q, wide, groups, 0, 4, 128, 0, 0, scale),
        prefill_attention(q, k16, v16, groups, 0, 0, 0, scale),
        rtol=RTOL, atol=ATOL, err_msg=msg)

    # Mixed sink / q4 / window rows, and decode agrees with the last prefill row.
    mixed = Q4Cache.empty(n_kv, max_seq, hd)
    kv_append_q4(k, v, mixed, 0, sink=4, win=24)
    pre = prefill_attention_q4(q, mixed, groups, 0, 4, 24, 2, 50, scale)
    kr, vr = read_kv_rows_q4(mixed, n - 1, 4, 24)
    assert _bits_equal(kr[:, 10], k_deq[:, 10]) and _bits_equal(kr[:, 90], k16[:, 90]), msg
    assert _bits_equal(vr[:, 1], v16[:, 1]), msg
    dec = decode_attention(q[-1], kr, vr, groups, n, 32, 4, 2, 50, scale)
    np.testing.assert_allclose(dec, pre[-1], rtol=RTOL, atol=ATOL, err_msg=msg)


def test_slots_partials_layout_and_attention(rng) -> None:
    r, seed = rng
    nslots, n_kv, groups, hd, max_seq = 3, 2, 2, 32, 300
    pos = np.array([250, 20, 130])
    ks, vs = empty_f32_cache(n_kv, max_seq, hd, nslots=nslots)
    for u in range(nslots):
        ks[u, :, :pos[u] + 1] = _normal(r, (n_kv, pos[u] + 1, hd))
        vs[u, :, :pos[u] + 1] = _normal(r, (n_kv, pos[u] + 1, hd))
    q = _normal(r, (nslots, n_kv * groups, hd))
    kps, cap, scale = 32, 6, 0.25
    m, lsum, acc, width = decode_partials_slots(q, ks, vs, pos, groups, kps, cap, 0, 0, scale)
    n_head = n_kv * groups
    assert width == max(decode_plan(int(p) + 1, kps, cap)[0] for p in pos)
    m3 = m.reshape(nslots, n_head, width)
    for u in range(nslots):
        n_splits, split_len = decode_plan(int(pos[u]) + 1, kps, cap)
        mu, lu, accu = decode_partials(q[u], ks[u], vs[u], groups, int(pos[u]) + 1, n_splits,
                                       split_len, 0, 0, scale)
        assert np.array_equal(m3[u, :, :n_splits].ravel(), mu), f"slot {u}, seed={seed}"
        assert np.array_equal(lsum.reshape(nslots, n_head, width)[u, :, :n_splits].ravel(), lu)
        assert np.array_equal(
            acc.reshape(nslots, n_head, width, hd)[u, :, :n_splits].ravel(), accu)
        assert np.all(m3[u, :, n_splits:] == -np.inf), f"off-plan is empty, seed={seed}"
    out = decode_attention_slots(q, ks, vs, pos, groups, kps, cap, 0, 0, scale)
    for u in range(nslots):
        want = decode_attention(q[u], ks[u], vs[u], groups, int(pos[u]) + 1, kps, cap, 0, 0,
                                scale)
        np.testing.assert_allclose(out[u], want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"slot {u}, seed={seed}")

    # The q4 slot kernels: rows come from each slot's cache view.
    q4 = Q4Cache.empty(n_kv, max_seq, hd, nslots=nslots)
    for u in range(nslots):
        rows_k = np.swapaxes(ks[u, :, :pos[u] + 1], 0, 1)
        rows_v = np.swapaxes(vs[u, :, :pos[u] + 1], 0, 1)
        kv_append_q4(rows_k, rows_v, q4.slot(u), 0, sink=4, win=32)

    def rows(u: int) -> tuple[np.ndarray, np.ndarray]:
        return read_kv_rows_q4(q4.slot(u), int(pos[u]), 4, 32)

    out_q4 = decode_attention_slots(q, rows, None, pos, groups, kps, cap, 0, 0, scale)
    for u in range(nslots):
        kr, vr = rows(u)
        mask = np.ones(pos[u] + 1, bool)
        want = _direct_decode(q[u], kr, vr, groups, mask, scale)
        np.testing.assert_allclose(out_q4[u], want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"slot {u}, seed={seed}")
