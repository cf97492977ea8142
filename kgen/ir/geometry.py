"""Launch geometry derived from a kernel's axes: the one home of the derived
quantities the spec checks, the launchers, the references and the cache objects
share -- the flash kernels' dynamic shared memory, the smallest head_dim a block
scores every key with, and a cache row's width (asked of the kernel's format)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kgen.ir.axes import (
    Combine,
    KeySplit,
    KStage,
    KvReads,
    LaneDims,
    Mode,
    Prefetch,
    QtileLoads,
    Schedule,
    StreamLoads,
    StreamSteps,
    Threads,
    VStage,
)
from kgen.ir.kernel import Kernel
from kgen.ir.spellings import K_TILE_ELEM, Q_ELEM
from kgen.ir.target import TARGET


def row_width(k: Kernel, head_dim: int, role: str = "k") -> int:
    """Array elements of one cache row of ``k``'s ``role`` (its K rows, or V rows)."""
    return k.pair.of(role).row_width(head_dim)


def streams(k: Kernel) -> bool:
    return k.schedule is Schedule.WARP_STREAM


def query_tiles(k: Kernel) -> bool:
    return k.schedule is Schedule.QUERY_TILE


def stream_hoisted(k: Kernel) -> bool:
    """warp_stream, stream_loads = hoisted: one head_dim (stream_head_dim), each unit's
    chunk a compile-time constant, every load of a step unconditional."""
    return streams(k) and k.stream_loads is StreamLoads.HOISTED


def stream_quads(k: Kernel) -> bool:
    """A hoisted warp_stream kernel with lane_dims = quads: dot lane l owns the dims of
    quads l + j * dot_lanes (flash_stream.cu.j2's LANE_DIM), K and V read a quad a load by
    the formats' quad readers."""
    return stream_hoisted(k) and k.lane_dims is LaneDims.QUADS


def quad_reads(k: Kernel) -> bool:
    """The kernel reads cache rows four elements a load (each side's quad reader:
    load_key_quad, or load_quad_raw): the cache arrays must start on their formats'
    quad_bytes."""
    return qtile_swizzle(k) or stream_quads(k)


def cache_load_bytes(k: Kernel, role: str) -> int:
    """The widest load a flash kernel's template issues from ``role``'s cache rows (the
    alignment its cache array needs): the format's quad reader where the kernel reads rows
    a quad a load (quad_reads), the raw V tile's words where it stages raw V rows
    (v_stage = shared_q4), else one element."""
    fmt = k.pair.of(role)
    widths = [fmt.itemsize]
    if quad_reads(k):
        widths.append(fmt.quad_bytes)
    if role == "v" and k.v_stage is VStage.SHARED_Q4:
        widths.append(ELEM_BYTES[RAW_V_WORD])
    return max(widths)


def stream_full_steps(k: Kernel) -> bool:
    """A hoisted warp_stream decode with stream_steps = split runs a step whose keys all
    lie in the split and the window from an unmasked copy of the step (the masked copy
    at the edges)."""
    return (stream_hoisted(k) and k.mode is not Mode.PREFILL
            and k.stream_steps is StreamSteps.SPLIT)


def stream_head_dim(k: Kernel) -> int:
    """The head_dim a hoisted warp_stream kernel serves: its whole register chunks."""
    return k.kreg_max_chunk * k.dot_lanes


# ---- schedule = query_tile (templates/kernels/flash_qtile.cu.j2) ----------------------
# A block owns tile_rows rows of one kv head's (query position, q head) pairs, row r of
# the kv head being query t = r / kv_groups, q head g = r % kv_groups (position major).
# Thread tid = ty * row_lanes + tx holds the micro_rows x micro_keys patch of S of rows
# ty + i * row_groups and keys tx + j * row_lanes of each tile, and the same rows' output
# columns tx + c * row_lanes (out_cols of them): a row's row_lanes lanes are adjacent
# lanes of one warp, so its max and sum reduce by shuffles.

def qtile_vec4(k: Kernel) -> bool:
    """query_tile, qtile_loads = vec4: float4 shared loads (q and K along head_dim, P
    along keys, V along a thread's column quads 4 * (tx + c * row_lanes) + 0..3)."""
    return query_tiles(k) and k.qtile_loads is QtileLoads.VEC4


def qtile_swizzle(k: Kernel) -> bool:
    """query_tile, qtile_loads = swizzle (templates/kernels/flash_qtile_swizzle.cu.j2):
    q and K rows of swizzle_stride(k) floats whose float4 c of row r sits at c ^ (r % 8)
    (a row's lanes and a warp's rows read distinct banks with no pad), V rows plain, P
    passed between a row's lanes by shuffles."""
    return query_tiles(k) and k.qtile_loads is QtileLoads.SWIZZLE


SWIZZLE_QUADS = 8  # float4s a swizzle permutes: 8 x 16 bytes, the 32 banks once


def swizzle_stride(k: Kernel) -> int:
    """qtile_loads = swizzle: floats per shared q, K and V row, max_head_dim in whole
    swizzle groups (a float4 index xor 7 stays inside the row) and whole rounds of a
    row's lanes' column quads (each lane reads out_cols / 4 quads of every V row)."""
    group = math.lcm(4 * SWIZZLE_QUADS, 4 * row_lanes(k))
    return -(-k.max_head_dim // group) * group


# qk_split > 1: a warp sums the block's whole S tile over its share of head_dim, its lanes
# QK_ROW_GROUPS along the rows (rows g + 8 i: their q loads hit 8 distinct swizzles, a
# bank each) by QK_KEY_GROUPS along the keys (keys g + 4 j: 4 distinct swizzles).
QK_ROW_GROUPS = SWIZZLE_QUADS
QK_KEY_GROUPS = TARGET.warp // QK_ROW_GROUPS


def qk_patch(k: Kernel) -> tuple[int, int]:
    """query_tile, qk_split > 1: the rows and keys of a lane's patch of its warp's share
    of S (tile_rows / 8 x tile_keys / 4)."""
    return k.tile_rows // QK_ROW_GROUPS, k.tile_keys // QK_KEY_GROUPS


def row_lanes(k: Kernel) -> int:
    """query_tile: the lanes sharing one row (tile_keys / micro_keys)."""
    return k.tile_keys // k.micro_keys


def row_groups(k: Kernel) -> int:
    """query_tile: threads along the rows (tile_rows / micro_rows)."""
    return k.tile_rows // k.micro_rows


def qtile_threads(k: Kernel) -> int:
    """query_tile: the block, one thread per micro-tile of the S tile."""
    return row_groups(k) * row_lanes(k)


def out_cols(k: Kernel) -> int:
    """query_tile: output columns a thread holds per row (max_head_dim over its row's
    lanes; vec4: whole quads of columns)."""
    if qtile_vec4(k) or qtile_swizzle(k):
        return 4 * -(-k.max_head_dim // (4 * row_lanes(k)))
    return -(-k.max_head_dim // row_lanes(k))


def p_stride(k: Kernel) -> int:
    """query_tile: floats per row of the shared P tile (a key of pad: no bank conflicts
    between the rows a warp reads; vec4: a float4 of pad, rows stay 16-byte aligned)."""
    return k.tile_keys + (4 if qtile_vec4(k) else 1)


def accumulators(k: Kernel) -> int:
    """query_tile: output accumulators a thread keeps in registers."""
    return k.micro_rows * out_cols(k)


def key_partials(k: Kernel) -> bool:
    """A query_tile prefill with key_split = partials: block x = tile * n_splits + split
    walks split's share of its tile's key tiles and writes (m, l, acc) partials, one
    combine head a (query row, q head), for the decode combine."""
    return query_tiles(k) and k.key_split is KeySplit.PARTIALS


def prefill_grid(k: Kernel, n: int, groups: int, n_head_kv: int,
                 n_splits: int = 1) -> tuple[int, int, int]:
    """The grid of a contiguous (position = host) prefill of ``n`` query rows: a block
    per query tile of each kv head (query_tile; with key_split = partials, n_splits
    blocks a tile), else per rows_per_block query rows."""
    if query_tiles(k):
        tiles = -(-n * groups // k.tile_rows)
        return (tiles * n_splits if key_partials(k) else tiles, n_head_kv, 1)
    return (-(-n // k.rows_per_block), n_head_kv, 1)


def paged_prefill_grid(k: Kernel, rows: int, max_query_len: int, groups: int,
                       n_head_kv: int, reqs: int, n_splits: int = 1) -> tuple[int, int, int]:
    """The grid of a paged varlen prefill of ``rows`` query rows in ``reqs`` requests,
    none longer than ``max_query_len`` (the host's bound): a block per query tile of
    each kv head of each request (query_tile, n_splits blocks a tile with key_split =
    partials; blocks past a request's rows return at once), else per query row of the
    batch."""
    if query_tiles(k):
        tiles = -(-max_query_len * groups // k.tile_rows)
        return (tiles * n_splits if key_partials(k) else tiles, n_head_kv, reqs)
    return (rows, n_head_kv, 1)


def tile_threads(k: Kernel) -> int:
    """Threads that score one tile: every key of a tile has its own dot lanes. A
    warp_stream block needs one unit of dot lanes (each unit streams its own keys); a
    query_tile block is its micro-tiles."""
    if query_tiles(k):
        return qtile_threads(k)
    return k.dot_lanes if streams(k) else k.tile_keys * k.dot_lanes


def stream_units(k: Kernel, head_dim: int) -> int:
    """warp_stream: units of dot_lanes lanes in a block, each streaming its own keys."""
    return block_threads(k, head_dim) // k.dot_lanes


# A quads decode (prefetch = next_step) merges its units' accs in phases of
# stream_merge_units units (templates/kernels/flash_stream.cu.j2): each phase's units
# store their weighted accs and each thread adds its dim of every head over them in unit
# order -- the serial merge's sums in its order, so its bits, with a barrier a phase
# where the serial merge had one a unit and one unit at work between them. A phase's
# buffer takes at most MERGE_BYTES_PER_THREAD bytes a thread of the block: a K80 SMX has
# 112 KB of shared memory for its 128K registers (0.875 bytes a register), so a block
# whose threads hold 110 or more registers keeps the blocks an SMX its registers allow
# (tests/cpu/test_stream_quads.py checks every quads decode against ptxas's count, those
# below 110 included). A phase's units divide the block's: 12 at head_dim 96 (8 dot lanes)
# merge in phases of 4, 24 at head_dim 80 in phases of a power of two dividing 24.
MERGE_BYTES_PER_THREAD = 96


def stream_merge_units(k: Kernel) -> int:
    """Units a phase of a quads decode's merge holds (0: the serial merge of the other
    warp_stream kernels): the most, a power of two that divides the units (every phase
    full: a phase adds all its slots), whose buffer fits MERGE_BYTES_PER_THREAD a thread."""
    if not (streams(k) and k.prefetch is not Prefetch.NONE and k.mode is Mode.DECODE):
        return 0
    hd = stream_head_dim(k)
    units = stream_units(k, hd)
    budget = block_threads(k, hd) * MERGE_BYTES_PER_THREAD
    p = 1
    while units % (p * 2) == 0 and p * 2 * k.max_groups * hd * 4 <= budget:
        p *= 2
    return p


def padded(k: Kernel) -> bool:
    return k.threads is Threads.WARPS


def block_threads(k: Kernel, head_dim: int) -> int:
    """Threads of a flash block: one per output dim, or that rounded up to whole warps;
    a query_tile block is fixed by its tile shape."""
    if query_tiles(k):
        return qtile_threads(k)
    if padded(k):
        return -(-head_dim // TARGET.warp) * TARGET.warp
    return head_dim


def head_dim_step(k: Kernel) -> int:
    """head_dim must be a multiple of this: whole warps (the dot shuffles use
    full-warp masks) or, in a padded block, whole dot chunks; and whole blocks of
    the format. A query_tile block takes any head_dim up to max_head_dim (its loops
    over dims are guarded): whole blocks of the format only."""
    if query_tiles(k):
        return math.lcm(k.pair.block, 4) if qtile_vec4(k) or qtile_swizzle(k) else k.pair.block
    base = k.dot_lanes if padded(k) else TARGET.warp
    return math.lcm(base, k.pair.block)


def min_head_dim(k: Kernel) -> int:
    """The smallest head_dim a flash block runs with: every key of a tile scored,
    whole warps (or dot chunks), whole format blocks; a hoisted warp_stream kernel
    runs with its one head_dim."""
    if stream_hoisted(k):
        return stream_head_dim(k)
    step = head_dim_step(k)
    hd = step
    while block_threads(k, hd) < tile_threads(k):
        hd += step
    return hd


def max_head_dim_launched(k: Kernel) -> int:
    """The widest head_dim a block of a (non-query_tile) flash kernel launches with:
    whole steps of head_dim, its threads within a block (hoisted: its one head_dim)."""
    if stream_hoisted(k):
        return stream_head_dim(k)
    step = head_dim_step(k)
    hd = TARGET.max_threads // step * step
    while hd > step and block_threads(k, hd) > TARGET.max_threads:
        hd -= step
    return hd


def register_k_floats(k: Kernel) -> int:
    """Floats of a register-K kernel's arrays of kreg_max_chunk a thread keeps in
    registers: the K chunk (block_tile); a warp_stream unit's accumulators for every
    group and the K and V chunks of each key in flight."""
    if streams(k):
        return (k.max_groups + 2 * k.keys_per_step) * k.kreg_max_chunk
    return k.kreg_max_chunk


@dataclass(frozen=True)
class Region:
    """One region of a flash block's dynamic shared memory, in carve order."""

    name: str      # the pointer the kernel carves
    ctype: str     # its element type
    step: str      # its element count as the kernel spells the next pointer's offset
    elems: Callable[[int, int], int]  # its element count at (groups, head_dim)


ELEM_BYTES = {"float": 4, "__half": 2, "unsigned int": 4}
RAW_V_WORD = "unsigned int"  # v_stage = shared_q4 copies raw V rows in these words


def flash_regions(k: Kernel) -> tuple[Region, ...]:
    """q group | K tile | scores [G][T] | probs [T][G] | m, l, corr [G] | V tile (or,
    warp_stream, q group | merge; query_tile, q tile | K-then-V tile | probs): the one
    table the launch geometry sums and the flash templates carve."""
    T = k.tile_keys
    if qtile_swizzle(k):  # rows of swizzle_stride floats at every head_dim; no P tile
        return (Region("q_s", "float", "(size_t)TILE_ROWS * QSTRIDE",
                       lambda G, hd: k.tile_rows * swizzle_stride(k)),
                Region("kv_s", "float", "", lambda G, hd: T * swizzle_stride(k)))
    if query_tiles(k):  # rows of head_dim + k_pad floats; K and V take turns in kv_s
        return (Region("q_s", "float", "(size_t)TILE_ROWS * kstride",
                       lambda G, hd: k.tile_rows * (hd + k.k_pad)),
                Region("kv_s", "float", "(size_t)TILE_KEYS * kstride",
                       lambda G, hd: T * (hd + k.k_pad)),
                Region("p_s", "float", "", lambda G, hd: k.tile_rows * p_stride(k)))
    out = [Region("q_s", Q_ELEM[k.q_stage], "(size_t)G * head_dim", lambda G, hd: G * hd)]
    if streams(k):  # q group | the units' merge: acc [phase units][G][hd], m, l [units][G]
        P = stream_merge_units(k)
        acc = (Region("acc_s", "float", "(size_t)MERGE_UNITS * G * head_dim",
                      lambda G, hd: P * G * hd) if P else
               Region("acc_s", "float", "(size_t)G * head_dim", lambda G, hd: G * hd))
        return tuple(out + [
            acc,
            Region("m_s", "float", "UNITS * G", lambda G, hd: stream_units(k, hd) * G),
            Region("l_s", "float", "UNITS * G", lambda G, hd: stream_units(k, hd) * G)])
    if k.k_stage is not KStage.REGISTERS:
        out.append(Region("k_s", K_TILE_ELEM[k.k_stage], "(size_t)TILE_KEYS * kstride",
                          lambda G, hd: T * (hd + k.k_pad)))
    out += [Region("score_s", "float", "G * TILE_KEYS", lambda G, hd: G * T),
            Region("p_s", "float", "G * TILE_KEYS", lambda G, hd: G * T),
            Region("m_s", "float", "G", lambda G, hd: G),
            Region("l_s", "float", "G", lambda G, hd: G),
            Region("corr_s", "float", "G", lambda G, hd: G)]
    if k.v_stage is VStage.SHARED_Q4:  # raw rows as 32-bit words
        out.append(Region("v_sh", RAW_V_WORD, "",
                          lambda G, hd: T * k.v_fmt.row_bytes(hd) // ELEM_BYTES[RAW_V_WORD]))
    return tuple(out)


def flash_shared_bytes(k: Kernel, groups: int, head_dim: int) -> int:
    return sum(r.elems(groups, head_dim) * ELEM_BYTES[r.ctype] for r in flash_regions(k))


@dataclass(frozen=True)
class ScoreScatter:
    """How a warp_stream unit reduce-scatters a step's dot products (templates/kernels/
    flash_stream.cu.j2): value n = g * bp + b, with keys_per_step and max_groups padded
    to powers of two (n of them); after a halving exchange at each of scatter_offs
    lane l holds the nr complete sums n = (l >> ns) * nr + r (ns > 0: 2^ns lanes hold
    each, summed over dup_offs). A lane's values are gl heads of bl keys; a head's
    keys span the lanes that differ at group_offs."""

    bp: int
    n: int
    nr: int
    ns: int
    bl: int
    gl: int
    scatter_offs: tuple[int, ...]
    dup_offs: tuple[int, ...]
    group_offs: tuple[int, ...]


def score_scatter(k: Kernel) -> ScoreScatter:
    def pow2(x: int) -> int:
        return 1 << max(x - 1, 0).bit_length()

    bp = pow2(k.keys_per_step)
    n = pow2(k.max_groups) * bp
    lg_n = (n - 1).bit_length()
    offs = tuple(1 << e for e in range(5, -1, -1) if 1 << e < k.dot_lanes)
    cut = min(lg_n, len(offs))
    nr = n // k.dot_lanes if n >= k.dot_lanes else 1
    ns = 0 if n >= k.dot_lanes else len(offs) - lg_n
    bl = min(bp, nr)
    return ScoreScatter(bp, n, nr, ns, bl, nr // bl, offs[:cut], offs[cut:],
                        tuple((1 << ns) << e for e in range(6) if 1 << e < bp // bl))


# ---- op = decode_combine (templates/kernels/decode_combine.cu.j2, lib/combine.cuh.j2) --
# serial: a block per head (row of the partials), a thread per output dim, head_dim
# threads. staged: a block of COMBINE_THREADS threads per COMBINE_DIMS dims of a head (a
# lane per dim): the splits go by in stages of COMBINE_THREADS, each warp loading 32 of a
# stage's acc rows at once (the next stage's while one folds) and each thread one split's
# m and l and weight; the stage lands in shared memory and one warp folds it in split
# order -- the serial form's arithmetic, its bits. Shared memory: a stage's acc rows
# (COMBINE_THREADS x COMBINE_DIMS floats) and (weight, l) pairs (ptxas's static shared
# memory; its sm_37 occupancy in `kgen list --json --resources`, its speed in the README).
COMBINE_THREADS = 128
COMBINE_DIMS = 32


def combine_staged(k: Kernel) -> bool:
    """Whether ``k`` merges split partials in stages (only a combine takes the key)."""
    return k.combine is Combine.STAGED


def combine_threads(k: Kernel, head_dim: int) -> int:
    """Threads of a combine block: head_dim (serial), COMBINE_THREADS (staged)."""
    return COMBINE_THREADS if combine_staged(k) else head_dim


def combine_grid(k: Kernel, heads: int, head_dim: int) -> tuple[int, int, int]:
    """The grid of a combine of ``heads`` rows of partials (n_head, or nslots x n_head):
    a block per head (serial), per COMBINE_DIMS of its dims (staged)."""
    return (heads, -(-head_dim // COMBINE_DIMS) if combine_staged(k) else 1, 1)


# ---- op = merge_attn_states (templates/kernels/merge_attn_states.cu.j2) --------------
# Row r = token * n_head + head of the [n_tokens][n_head][head_dim] outputs is merged by
# one warp (its lanes along head_dim, 32 dims a step, coalesced); a block is MERGE_ROWS
# warps, the 1-D grid covers every row, whatever head_dim is.
MERGE_ROWS = 4


def merge_threads() -> int:
    """Threads of a merge block: MERGE_ROWS warps."""
    return MERGE_ROWS * TARGET.warp


def merge_grid(n_tokens: int, n_head: int) -> tuple[int, int, int]:
    """The grid of a merge over n_tokens x n_head rows: a warp per row."""
    return (-(-n_tokens * n_head // MERGE_ROWS), 1, 1)


# ---- multi-head latent attention (templates/kernels/{concat_and_cache_mla,
# gather_mla_cache, mla_decode, mla_combine}.cu.j2) -------------------------------------
# One latent cache row per token: kv_lora_rank latent columns, then rope_dim rotary
# columns (MLA_ROW in all); one KV head, and V is the row's first MLA_LATENT columns.
MLA_LATENT = 512  # kv_lora_rank: kv_c's width, V's head size and the output's
MLA_ROPE = 64     # rope_dim: k_pe's width
MLA_ROW = MLA_LATENT + MLA_ROPE  # a cache row, and the query's (and q.k's) head size

# concat_and_cache_mla: a block stores one slot's row, MLA_STORE_THREADS threads along it.
MLA_STORE_THREADS = 192
# gather_mla_cache: a warp copies one token's row (float4s), MLA_GATHER_ROWS warps a block.
MLA_GATHER_ROWS = 4
# mla_decode: a block serves MLA_HEADS q heads of one request over one key split. It
# stages MLA_TILE latent rows in shared memory once for all of them; warp w scores
# MLA_HEADS / warps heads (each lane holds MLA_ROW / 32 query elements of each in
# registers; the TILE partial dots reduce-scatter across the lanes), then thread t
# accumulates V columns t % MLA_V_THREADS + MLA_V_THREADS * i of MLA_HEADS /
# (MLA_THREADS / MLA_V_THREADS) heads.
MLA_TILE = 16
MLA_HEADS = 16
MLA_THREADS = 256
MLA_V_COLS = 4                       # V columns a thread accumulates, per head it owns
MLA_V_THREADS = MLA_LATENT // MLA_V_COLS  # threads covering one head's V columns
# mla_combine: a block merges one (request, head) row, MLA_COMBINE_THREADS threads along V.
MLA_COMBINE_THREADS = 128


# mla_prefill: varlen attention with QK head size MLA_PREFILL_QK (nope 128 + rope 64) and V
# head size MLA_PREFILL_V, H q heads = H kv heads. A block is MLA_PREFILL_ROWS warps, warp w
# serving query row qt * ROWS + w of one (request, head); the block stages MLA_PREFILL_TILE
# keys' K and V rows in shared memory once for all its rows; each lane holds
# MLA_PREFILL_QK / 32 query elements, the TILE partial dots reduce-scatter across the lanes
# (lane l ends with one key's dot), and lane l accumulates V columns l + 32 c.
MLA_PREFILL_QK = 192
MLA_PREFILL_V = 128
MLA_PREFILL_ROWS = 16
MLA_PREFILL_TILE = 32


def mla_prefill_grid(max_seqlen_q: int, n_head: int, reqs: int) -> tuple[int, int, int]:
    """mla_prefill: (query tiles of the longest request, heads, requests)."""
    return (-(-max_seqlen_q // MLA_PREFILL_ROWS), n_head, reqs)


def mla_prefill_shared() -> int:
    """mla_prefill's static shared memory in bytes: the K and V tiles, each row's p."""
    return 4 * (MLA_PREFILL_TILE * (MLA_PREFILL_QK + MLA_PREFILL_V)
                + MLA_PREFILL_ROWS * MLA_PREFILL_TILE)


MLA_GATHER_QUAD = 16  # bytes: gather_mla_cache copies rows as float4s (its src_cache
#                       and dst alignment)


def mla_row_quads(k: Kernel) -> int:
    """gather_mla_cache: 16-byte quads of one latent row of the kernel's in_dtype (MLA_ROW
    elements: 144 quads of f32, 72 of a 16-bit type); a warp copies a row quad by quad."""
    return MLA_ROW * k.in_dtype.fmt.itemsize // MLA_GATHER_QUAD


def mla_store_grid(n_slots: int) -> tuple[int, int, int]:
    """concat_and_cache_mla: a block per slot_mapping entry."""
    return (n_slots, 1, 1)


def mla_gather_threads() -> int:
    """gather_mla_cache: MLA_GATHER_ROWS warps."""
    return MLA_GATHER_ROWS * TARGET.warp


def mla_gather_grid(n_tokens: int) -> tuple[int, int, int]:
    """gather_mla_cache: a warp per workspace row."""
    return (-(-n_tokens // MLA_GATHER_ROWS), 1, 1)


def mla_head_groups(n_head: int) -> int:
    """mla_decode: blocks along the q heads (MLA_HEADS each, the last one partial)."""
    return -(-n_head // MLA_HEADS)


def mla_decode_grid(n_head: int, splits: int, reqs: int) -> tuple[int, int, int]:
    """mla_decode: (head groups, splits, requests); the head groups of one split are
    adjacent blocks, so they read its latent rows while they are in L2."""
    return (mla_head_groups(n_head), splits, reqs)


def mla_decode_shared() -> int:
    """mla_decode's static shared memory in bytes: the latent tile, the probabilities
    and rescale factors of its heads, the tile's row flags."""
    return 4 * (MLA_TILE * MLA_ROW + MLA_HEADS * MLA_TILE + MLA_HEADS + MLA_TILE)


def mla_combine_grid(reqs: int, n_head: int) -> tuple[int, int, int]:
    """mla_combine: a block per (request, head)."""
    return (reqs * n_head, 1, 1)


def mla_split_keys(seq_len: int, splits: int) -> int:
    """Keys of each split of a request of ``seq_len`` keys cut in ``splits``: ceil(seq_len /
    splits) rounded up to whole tiles (the kernels compute the same on the device; later
    splits may be empty, and both stages skip them)."""
    if seq_len <= 0:
        return 0
    per = -(-seq_len // splits)
    return -(-per // MLA_TILE) * MLA_TILE


def mla_default_splits(max_seq_len: int, sms: int) -> int:
    """The split count when num_kv_splits = 0: min(next_pow2(max(1, max_seq_len /
    MLA_SPLIT_KEYS)), 2 * SM count), the engine's rule (integer division)."""
    want = max(1, max_seq_len // MLA_SPLIT_KEYS)
    return min(1 << (want - 1).bit_length(), 2 * sms)


MLA_SPLIT_KEYS = 512  # the default split count grows by one split per this many keys
# ---- op = dflash_attention (templates/kernels/dflash_attention.cu.j2) -----------------
# Row w = t * n_head + h of the [n_rows][n_head][head_dim] query and output (query row t,
# q head h) is attended by one warp: lane l holds dims l, l + 32, ... of q and of the
# output (dflash_chunks(k) of them, registers), and the warp walks the row's keys in
# ascending order, keys_per_step at a time. A block is DFLASH_ROWS warps (the q heads
# of one row lie in adjacent warps: those of one kv head read the same keys); the 1-D
# grid covers every row, whatever the requests' lengths: the host needs only n_rows.
DFLASH_ROWS = 4


def dflash_chunks(k: Kernel) -> int:
    """Dims of q and of the output a lane holds: max_head_dim over a warp's lanes."""
    return -(-k.max_head_dim // TARGET.warp)


def dflash_held_floats(k: Kernel) -> int:
    """Floats a dflash lane keeps in registers: its q and output dims, and the K and V
    dims of the keys_per_step keys in flight."""
    return dflash_chunks(k) * (2 + 2 * k.keys_per_step)


def dflash_threads() -> int:
    """Threads of a dflash block: DFLASH_ROWS warps."""
    return DFLASH_ROWS * TARGET.warp


def dflash_grid(n_rows: int, n_head: int) -> tuple[int, int, int]:
    """The grid of a dflash launch over n_rows x n_head (query row, q head) rows."""
    return (-(-n_rows * n_head // DFLASH_ROWS), 1, 1)


# ---- op = dense_attention (templates/kernels/dense_attention.cu.j2) -------------------
# One sequence: query, out [T][Hq][D], key / value [T][Hkv][D]; q head h reads kv head
# h / G (G = Hq / Hkv). Every (query row t, q head h) is one warp, folding its keys with
# lib/dflash.cuh.j2's arithmetic (lane l: dims l, l + 32, ..., dflash_chunks(k) of them).
# Both kv_reads share one geometry: block (b, hk) is DENSE_ROWS warps over kv head hk's
# T * G rows in (t, g) order, warp w of it row i = b * DENSE_ROWS + w, t = i / G,
# h = hk * G + i % G; so a block's warps read the same kv head's keys (shared_tile: a
# K and a V tile of tile_keys rows x max_head_dim floats, staged by the whole block).
DENSE_ROWS = 8


def dense_threads() -> int:
    """Threads of a dense_attention block: DENSE_ROWS warps."""
    return DENSE_ROWS * TARGET.warp


def dense_grid(n_rows: int, n_head: int, n_head_kv: int) -> tuple[int, int, int]:
    """The grid over n_rows x n_head (query row, q head) warps, kv head along y."""
    return (-(-n_rows * (n_head // n_head_kv) // DENSE_ROWS), n_head_kv, 1)


def dense_shared_bytes(k: Kernel) -> int:
    """Static shared memory of a dense_attention block: the K and V tiles (shared_tile),
    f32 whatever in_dtype (widened once when staged, exactly as a global read widens)."""
    if k.kv_reads is not KvReads.SHARED_TILE:
        return 0
    return 2 * k.tile_keys * k.max_head_dim * 4
