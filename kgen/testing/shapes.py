"""The test shapes kgen.testing.testgen draws on: the candidate cases of each op (its
op object names its own: kgen.ops, ``case_candidates``), the query_tile ones derived
from a kernel's tiles, and the flash shapes derived from a kernel's head_dims and group
counts (a small launch over a partial last tile, each attention option switched on).

Nothing here asks an op object: the op modules import this module.
"""

from __future__ import annotations

from collections.abc import Callable

from kgen.ir.axes import KEYS, Mode, Position, Sinks, SoftCap, Window
from kgen.ir.geometry import min_head_dim, query_tiles
from kgen.ir.kernel import Kernel
from kgen.testing.case import Case

# Why a kernel cannot launch at (head_dim, groups), or None: its op's shape_refusal.
Refusal = Callable[[Kernel, int, int], "str | None"]

QZ = [
    Case("n3_h8_hd64", n=3, n_head=8, head_dim=64),
    Case("n7_h3_hd40_partial_block", n=7, n_head=3, head_dim=40),
    Case("n2_h16_hd256", n=2, n_head=16, head_dim=256),
]

APPEND = [
    Case("n5_pos3", n=5, n_head_kv=2, head_dim=256, max_seq=64, pos0=3, sink=4, win=16),
    Case("n9_ring_wrap", n=9, n_head_kv=1, head_dim=256, max_seq=32, pos0=28),
    Case("n2_hd1024", n=2, n_head_kv=1, head_dim=1024, max_seq=8, pos0=1, sink=8, win=4),
    Case("n40_window_ring_laps", n=40, n_head_kv=2, head_dim=128, max_seq=320, pos0=250,
         sink=8, win=256),
    Case("n3_no_shadows_hd64", n=3, n_head_kv=3, head_dim=64, max_seq=16, pos0=0),
]
APPEND_DEV = [
    Case("pos40", n=1, n_head_kv=2, head_dim=256, max_seq=64, positions=(40,), sink=4,
         win=16),
    Case("pos300_ring", n=1, n_head_kv=1, head_dim=128, max_seq=320, positions=(300,),
         sink=8, win=64),
    Case("pos70_wraps", n=1, n_head_kv=1, head_dim=256, max_seq=64, positions=(70,)),
]
APPEND_SLOTS = [
    Case("ragged3", n=3, n_head_kv=2, head_dim=256, max_seq=320, positions=(0, 7, 300),
         sink=8, win=32),
    Case("two_slots_hd64", n=2, n_head_kv=1, head_dim=64, max_seq=16, positions=(15, 3)),
]

PREFILL = [
    Case("g1_n5", n=5, n_head=2, n_head_kv=2, max_seq=32),
    Case("g8_n37_pos21_partial_tile", n=37, n_head=16, n_head_kv=2, max_seq=96, pos0=21,
         sink=4, win=24),
    Case("g3_n16_pos300_window", n=16, n_head=6, n_head_kv=2, max_seq=320, pos0=300,
         attn_sink=8, attn_win=64, sink=8, win=64),
    Case("g4_hd512_n20_window", n=20, n_head=8, n_head_kv=2, head_dim=512, max_seq=160,
         pos0=100, attn_sink=4, attn_win=40, sink=4, win=40),
    Case("g2_n9_pos700_long", n=9, n_head=4, n_head_kv=2, max_seq=720, pos0=700, sink=2,
         win=128),
    Case("g5_n1_pos0", n=1, n_head=5, n_head_kv=1, max_seq=16),
    Case("g2_n200_ring_floor", n=200, n_head=2, n_head_kv=1, max_seq=272, pos0=60, sink=2,
         win=100),
]

DECODE = [
    Case("g2_seq1", n_head=4, n_head_kv=2, seq_len=1, max_seq=16, kps=64, cap=8),
    Case("g8_seq17_kps8", n_head=16, n_head_kv=2, seq_len=17, max_seq=32, kps=8, cap=4,
         sink=4, win=8),
    Case("g3_seq300_window", n_head=6, n_head_kv=2, seq_len=300, max_seq=320, kps=64, cap=8,
         attn_sink=4, attn_win=50, sink=8, win=64),
    Case("g4_hd512_seq77", n_head=4, n_head_kv=1, head_dim=512, seq_len=77, max_seq=80,
         kps=16, cap=16, sink=2, win=16),
    Case("g8_seq1000_long", n_head=8, n_head_kv=1, seq_len=1000, max_seq=1024, kps=128, cap=16,
         sink=8, win=256),
]
DECODE_SLOTS = [
    Case("ragged_0_130_700", n_head=4, n_head_kv=2, max_seq=704, positions=(0, 130, 700),
         kps=64, cap=8, sink=4, win=64),
    Case("window_ragged", n_head=8, n_head_kv=1, max_seq=320, positions=(299, 16),
         kps=32, cap=16, attn_sink=4, attn_win=40, sink=4, win=40),
]
COMBINE = [
    Case("h16_s5", n_head=16, head_dim=256, n_splits=5, seq_len=300, kps=64, cap=8),
    Case("h3_s1_hd64", n_head=3, head_dim=64, n_splits=1, seq_len=10, kps=64, cap=8),
    Case("h8_s8", n_head=8, head_dim=128, n_splits=8, seq_len=1000, kps=64, cap=8),
    # more splits than two of a staged combine's stages (the last one part full) and a
    # head_dim that is no whole number of its 32-dim blocks
    Case("h5_s300_hd72", n_head=5, head_dim=72, n_splits=300, seq_len=40000, kps=128,
         cap=300),
    # wider than a block of head_dim threads: the staged combine's alone
    Case("h2_s3_hd1500", n_head=2, head_dim=1500, n_splits=3, seq_len=300, kps=128, cap=3),
]

# merge_attn_states: n tokens, n_head heads, head_dim = Dv (the engine's 128 and 512, and
# head sizes that are no whole warps or batches of four dims a lane); rows (token, head)
# that fill no whole block; prefill_tokens_with_context -1, 0, T / 2 and T; the LSE
# patterns of kgen.testing.merge (edges: both -inf, +inf, one side empty, differences
# whose exp underflows, magnitudes near 1e4).
MERGE = [
    Case("t1_h1_dv128", n=1, n_head=1, head_dim=128),
    Case("t1_h128_dv128_ctx0_edges", n=1, n_head=128, head_dim=128,
         prefill_tokens_with_context=0, lse_pattern="edges"),
    Case("t37_h3_dv128", n=37, n_head=3, head_dim=128),
    Case("t37_h3_dv128_ctx18_edges", n=37, n_head=3, head_dim=128,
         prefill_tokens_with_context=18, lse_pattern="edges"),
    Case("t64_h16_dv128_ctx64_wide", n=64, n_head=16, head_dim=128,
         prefill_tokens_with_context=64, lse_pattern="wide"),
    Case("t33_h128_dv128_ctx16_edges", n=33, n_head=128, head_dim=128,
         prefill_tokens_with_context=16, lse_pattern="edges"),
    Case("t1000_h1_dv128_wide", n=1000, n_head=1, head_dim=128, lse_pattern="wide"),
    Case("t1_h16_dv512_ctx1", n=1, n_head=16, head_dim=512, prefill_tokens_with_context=1),
    Case("t1_h128_dv512_edges", n=1, n_head=128, head_dim=512, lse_pattern="edges"),
    Case("t37_h3_dv512_ctx0", n=37, n_head=3, head_dim=512, prefill_tokens_with_context=0),
    Case("t50_h5_dv512_ctx25_wide", n=50, n_head=5, head_dim=512,
         prefill_tokens_with_context=25, lse_pattern="wide"),
    Case("t9_h7_dv512_ctx9_edges", n=9, n_head=7, head_dim=512,
         prefill_tokens_with_context=9, lse_pattern="edges"),
    Case("t301_h16_dv512_ctx150_wide", n=301, n_head=16, head_dim=512,
         prefill_tokens_with_context=150, lse_pattern="wide"),
    Case("t33_h128_dv512_edges", n=33, n_head=128, head_dim=512, lse_pattern="edges"),
    Case("t7_h2_dv40_edges", n=7, n_head=2, head_dim=40, lse_pattern="edges"),
    Case("t5_h3_dv100_ctx2", n=5, n_head=3, head_dim=100, prefill_tokens_with_context=2),
    Case("t6_h5_dv576_ctx_past_t", n=6, n_head=5, head_dim=576,
         prefill_tokens_with_context=1000, lse_pattern="edges"),
]

# dflash_attention: requests are (block rows, context rows); the dense kernel reads the
# blocks only. Blocks of 1 to 64 rows (the engine's 1 + k draft rows), an empty request,
# rows past the last request; bidirectional, causal, sliding windows of 1, 3 and wider
# than the block (and <= 0: plain causal); GQA 1 to 8 q heads per kv head; the engine's
# head sizes 64, 128, 256 and head sizes that are no whole warps; contexts of 0 to 32k
# keys over pages of 1, 7 and 16 positions, with windows reaching into the context.
DFLASH_DENSE = [
    Case("r1_len1_hd128", requests=((1, 0),), n_head=4, n_head_kv=4, head_dim=128),
    Case("r3_len16_hd128_g4_bidir", requests=((16, 0),) * 3, n_head=8, n_head_kv=2,
         head_dim=128),
    Case("r3_len16_hd128_g4_causal", requests=((16, 0),) * 3, n_head=8, n_head_kv=2,
         head_dim=128, causal=True),
    Case("r4_ragged_hd64_causal_win3", requests=((1, 0), (7, 0), (16, 0), (64, 0)),
         n_head=4, n_head_kv=1, head_dim=64, causal=True, sliding_window=3),
    Case("r2_len64_hd256_g8_causal_win0", requests=((64, 0), (33, 0)), n_head=16,
         n_head_kv=2, head_dim=256, causal=True, sliding_window=0),
    Case("r3_empty_request_hd256_bidir_pad5", requests=((5, 0), (0, 0), (9, 0)), n_head=4,
         n_head_kv=2, head_dim=256, pad_rows=5),
    Case("r2_len33_hd80_causal_win1", requests=((33, 0), (2, 0)), n_head=6, n_head_kv=3,
         head_dim=80, causal=True, sliding_window=1),
    Case("r2_hd100_causal_window_negative", requests=((12, 0), (17, 0)), n_head=2,
         n_head_kv=1, head_dim=100, causal=True, sliding_window=-4),
    Case("r2_len64_hd128_causal_win100", requests=((64, 0), (40, 0)), n_head=4,
         n_head_kv=2, head_dim=128, causal=True, sliding_window=100),
    Case("r8_len16_hd128_h32_kv8_bidir", requests=((16, 0),) * 8, n_head=32, n_head_kv=8,
         head_dim=128),
]
# dense_attention: one sequence of n rows. The vision tower's head sizes 64, 72, 80
# (a 14 x 14 + 1 patch grid), the audio encoder's 1500 frames, head sizes that are no
# whole warps, GQA 1 to 8 q heads per kv head (7: a block's warps span query rows
# mid-group), bidirectional and causal, one key, sequences that end mid-tile.
DENSE = [
    Case("t1_hd64_one_key", n=1, n_head=4, n_head_kv=4, head_dim=64),
    Case("t197_hd72_h16_bidir", n=197, n_head=16, n_head_kv=16, head_dim=72),
    Case("t256_hd64_h16_bidir", n=256, n_head=16, n_head_kv=16, head_dim=64),
    Case("t100_hd80_h12_kv4_causal", n=100, n_head=12, n_head_kv=4, head_dim=80,
         causal=True),
    Case("t65_hd128_g8_causal", n=65, n_head=8, n_head_kv=1, head_dim=128, causal=True),
    Case("t33_hd100_g3_bidir", n=33, n_head=6, n_head_kv=2, head_dim=100),
    Case("t7_hd31_g7_causal", n=7, n_head=7, n_head_kv=1, head_dim=31, causal=True),
    Case("t300_hd128_g4_causal", n=300, n_head=8, n_head_kv=2, head_dim=128, causal=True),
    Case("t1500_hd64_h20_bidir", n=1500, n_head=20, n_head_kv=20, head_dim=64),
    Case("t1500_hd64_h8_g2_causal", n=1500, n_head=8, n_head_kv=4, head_dim=64,
         causal=True),
]
DFLASH_PAGED = [
    Case("r1_ctx0_len4_hd128_window_negative", requests=((4, 0),), n_head=4, n_head_kv=2,
         head_dim=128, causal=True, sliding_window=-3),
    Case("r2_ctx9_len8_hd128_bs4_win1", requests=((8, 9), (2, 3)), n_head=4, n_head_kv=2,
         head_dim=128, block_size=4, causal=True, sliding_window=1),
    Case("r2_ctx37_len16_hd128_bs16_causal", requests=((16, 37), (16, 5)), n_head=8,
         n_head_kv=2, head_dim=128, block_size=16, causal=True),
    Case("r2_ctx37_len16_hd128_bs16_bidir", requests=((16, 37), (16, 5)), n_head=8,
         n_head_kv=2, head_dim=128, block_size=16),
    Case("r3_ragged_hd64_bs1_causal", requests=((1, 3), (7, 0), (5, 11)), n_head=4,
         n_head_kv=1, head_dim=64, block_size=1, causal=True),
    Case("r2_ctx100_len8_hd64_bs7_win20", requests=((8, 100), (8, 13)), n_head=4,
         n_head_kv=2, head_dim=64, block_size=7, causal=True, sliding_window=20),
    Case("r2_ctx50_len16_hd256_g8_win3_pad3", requests=((16, 50), (3, 1)), n_head=16,
         n_head_kv=2, head_dim=256, block_size=16, causal=True, sliding_window=3,
         pad_rows=3),
    Case("r3_empty_block_hd80_bs16_bidir", requests=((6, 20), (0, 40), (9, 16)), n_head=6,
         n_head_kv=3, head_dim=80, block_size=16),
    Case("r2_ctx4000_len64_hd256_bidir", requests=((64, 4000), (17, 2500)), n_head=4,
         n_head_kv=1, head_dim=256, block_size=16),
    Case("r1_ctx32768_len16_hd128_causal", requests=((16, 32768),), n_head=4, n_head_kv=1,
         head_dim=128, block_size=16, causal=True),
]


PAGED_APPEND = [
    Case("n7_block4", n=7, n_head_kv=2, head_dim=256, block_size=4),
    Case("n33_block16_hd128", n=33, n_head_kv=1, head_dim=128, block_size=16),
]
PAGED_PREFILL = [  # (query rows, keys) per request, aligned to each request's end
    Case("three_requests", requests=((5, 21), (1, 40), (16, 16)), n_head=8, n_head_kv=2,
         block_size=16),
    Case("block5_ragged", requests=((7, 7), (3, 50), (2, 2)), n_head=4, n_head_kv=1,
         block_size=5),
    Case("long_window", requests=((9, 300), (4, 33)), n_head=6, n_head_kv=2, block_size=16,
         attn_sink=4, attn_win=40),
]
PAGED_DECODE = [
    Case("three_requests", requests=((1, 1), (1, 130), (1, 700)), n_head=4, n_head_kv=2,
         block_size=16, kps=64, cap=8),
    Case("block5_window", requests=((1, 299), (1, 16)), n_head=8, n_head_kv=1, block_size=5,
         kps=32, cap=16, attn_sink=4, attn_win=40),
]


def query_tile_cases(k: Kernel, refusal: Refusal) -> list[Case]:
    """schedule = query_tile: at each of head_dim 64, 128 and 256 the kernel accepts,
    batches that are no whole number of query tiles (rows = queries x groups), with 1,
    4 and 8 q heads per kv head, chunked (pos0 > 0), a long context under a few
    queries, and the tile-granular window (tiles no row of a block sees are skipped)."""
    T, BM = k.tile_keys, k.tile_rows
    out = []
    for hd in (64, 128, 256):
        if refusal(k, hd, 1) is not None:
            continue
        n1 = BM + 5  # one q head per kv head: a full tile and a partial one
        out += [
            Case(f"qt_hd{hd}_g1_n{n1}_pos0", n=n1, n_head=2, n_head_kv=2, head_dim=hd,
                 max_seq=n1 + 8, pos0=0),
            Case(f"qt_hd{hd}_g4_n45_pos30", n=45, n_head=8, n_head_kv=2, head_dim=hd,
                 max_seq=96, pos0=30),
            Case(f"qt_hd{hd}_g8_n50_pos7", n=50, n_head=8, n_head_kv=1, head_dim=hd,
                 max_seq=64, pos0=7),
            Case(f"qt_hd{hd}_g2_n3_pos500_long", n=3, n_head=4, n_head_kv=2, head_dim=hd,
                 max_seq=512, pos0=500),
            Case(f"qt_hd{hd}_g4_n60_pos100_window", n=60, n_head=4, n_head_kv=1, head_dim=hd,
                 max_seq=200, pos0=100, attn_sink=3, attn_win=2 * T + 5),
        ]
    return out


def paged_query_tile_cases(k: Kernel, refusal: Refusal) -> list[Case]:
    """schedule = query_tile over pages: at each of head_dim 64, 128 and 256 the kernel
    accepts, requests of several query tiles and of part of one (rows = queries x
    groups), an empty request (its blocks return at once), chunks after a context,
    1, 4 and 8 q heads per kv head, pages of 5 and 16 positions, and the tile-granular
    window."""
    T, BM = k.tile_keys, k.tile_rows
    out = []
    for hd in (64, 128, 256):
        if refusal(k, hd, 1) is not None:
            continue
        out += [
            Case(f"pqt_hd{hd}_g4_tiles", requests=((2 * BM // 4 + 5, 2 * BM + 40), (3, 300),
                                                    (0, 9), (BM // 4, BM // 4)),
                 n_head=8, n_head_kv=2, head_dim=hd, block_size=16),
            Case(f"pqt_hd{hd}_g1_block5", requests=((BM + 5, BM + 20), (1, 1)), n_head=2,
                 n_head_kv=2, head_dim=hd, block_size=5),
            Case(f"pqt_hd{hd}_g8", requests=((50, 57), (9, 200)), n_head=8, n_head_kv=1,
                 head_dim=hd, block_size=16),
            Case(f"pqt_hd{hd}_g2_window", requests=((60, 160), (7, 40)), n_head=4,
                 n_head_kv=2, head_dim=hd, block_size=16, attn_sink=3, attn_win=2 * T + 5),
        ]
    return out


def flash_case(k: Kernel, hd: int, groups: int, name: str) -> Case:
    """A small flash launch at ``hd`` with ``groups`` q heads per kv head, over a
    partial last tile, in the form ``k``'s position takes."""
    T = k.tile_keys
    if k.position is Position.PAGED:
        reqs = ((T + 3, 2 * T + 4), (1, T + 1)) if k.mode is Mode.PREFILL else \
            ((1, 3 * T + 3), (1, T))
        return Case(name, requests=reqs, n_head=2 * groups, n_head_kv=2, head_dim=hd,
                    block_size=T, kps=T, cap=4)
    if k.mode is Mode.PREFILL:
        return Case(name, n=T + 3, n_head=2 * groups, n_head_kv=2, head_dim=hd,
                    max_seq=4 * T + 8, pos0=T + 1, sink=2, win=T + 5)
    if k.position is Position.SLOTS:
        return Case(name, n_head=groups, n_head_kv=1, head_dim=hd, max_seq=4 * T + 8,
                    positions=(2 * T + 2, 0, T), kps=T, cap=4, sink=2, win=T)
    return Case(name, n_head=2 * groups, n_head_kv=2, head_dim=hd, max_seq=4 * T + 8,
                seq_len=3 * T + 3, kps=T, cap=4, sink=2, win=T)


def option_cases(k: Kernel, base: Case) -> list[Case]:
    """The attention options a kernel has, each switched on over a small shape:
    key-exact windows (narrow, one key with a sink prefix, reaching right of the
    query under a full mask), soft-capping, learned sinks, and all together."""
    out = []
    if k.window is Window.EXACT:
        out += [base.with_(name=f"{base.name}_win5", win_left=5, win_right=0),
                base.with_(name=f"{base.name}_win0_sink3", win_left=0, attn_sink=3),
                base.with_(name=f"{base.name}_win11_right3", win_left=11, win_right=3)]
    if k.softcap is SoftCap.TANH:
        out.append(base.with_(name=f"{base.name}_softcap1", softcap=1.0))
    if k.sinks is Sinks.LEARNED:
        out.append(base.with_(name=f"{base.name}_sinks", sinks=True))
    if len(out) > 1:
        out.append(base.with_(name=f"{base.name}_all_options", win_left=7, attn_sink=2,
                              softcap=2.0 if k.softcap is SoftCap.TANH else 0.0,
                              sinks=k.sinks is Sinks.LEARNED))
    return out


# The head sizes of current models (Llama, Mistral, Qwen: 128; older and small
# models: 64; some 80, 96, 112, 192; Gemma 256; a few 512; small models and vision
# towers 40, 48 and 72): every flash kernel is tested at each one it accepts.
MODEL_HEAD_DIMS = (40, 48, 64, 72, 80, 96, 112, 128, 192, 256, 512)


def top_groups(k: Kernel, hd: int, refusal: Refusal) -> int:
    """The largest group count whose shared memory fits at head_dim ``hd``."""
    top = k.max_groups
    while top > 1 and refusal(k, hd, top) is not None:
        top -= 1
    return top


def flash_shapes(k: Kernel, refusal: Refusal) -> list[tuple[int, int]]:
    """(head_dim, groups): the smallest head_dim with one group and with the most,
    then every model head size the kernel accepts, with the most groups -- for a query
    tile, whose rows pack the groups (its bound a contract, sizing nothing), at most the
    axis default's, as many as a decode takes (the bound itself is the first shape's)."""
    hd0 = min_head_dim(k)  # a flash kernel's smallest head_dim
    shapes = [(hd0, g) for g in sorted({1, top_groups(k, hd0, refusal)})]
    cap = KEYS["max_groups"].default if query_tiles(k) else k.max_groups
    shapes += [(hd, min(cap, top_groups(k, hd, refusal))) for hd in MODEL_HEAD_DIMS
               if hd != hd0 and refusal(k, hd, 1) is None]
    return shapes
