"""The spec's vocabulary: every key a kernel may set, its values and default.

Adding a value to an axis (a staging mode, window policy) is an entry here, a
row in ``kgen/spellings.py`` and a template piece; the ``kv`` axis takes the
names registered in ``kgen.formats``, which the built-in set ``formats`` holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from kgen.formats import FORMATS, KvFormat, KvFormatName
from kgen.ir.target import TARGET


class Op(StrEnum):
    QZ_SPLIT = "qz_split"              # split the joint q+gate projection
    KV_APPEND = "kv_append"            # write new K/V rows into the cache
    FLASH = "flash"                    # tiled online-softmax attention
    DECODE_COMBINE = "decode_combine"  # merge split-decode partials
    MERGE_ATTN_STATES = "merge_attn_states"  # the engine's MergeAttnStates: two partial
    #                                          results over disjoint keys, by their LSEs
    MLA_STORE = "concat_and_cache_mla"  # MLA: latent kv_c and k_pe rows into the paged cache
    MLA_GATHER = "gather_mla_cache"     # MLA: requests' cache rows into a contiguous workspace
    MLA_DECODE = "mla_decode"           # MLA decode, split stage: (m, l, acc) per key split
    MLA_COMBINE = "mla_combine"         # MLA decode, merge stage: splits in ascending order
    MLA_PREFILL = "mla_prefill"         # MLA prefill: varlen attention, QK 192, V 128
    DFLASH_ATTENTION = "dflash_attention"  # the engine's DFlash block attention: each
    #                                        query attends only its request's block
    #                                        (and, paged, that request's context)
    DENSE_ATTENTION = "dense_attention"  # the engine's AttentionDenseFast / AttentionDenseFlash:
    #                                      one sequence, a warp per (query, q head)
    MASK_EMPTY_CONTEXT_LSE = "mask_empty_context_lse"  # chunked prefill: the context LSE
    #                                                    of a request with no context is -inf




class Mode(StrEnum):
    PREFILL = "prefill"  # one block per query row, normalised output
    DECODE = "decode"    # one block per key split, (m, l, acc) partials


class Position(StrEnum):
    HOST = "host"      # position passed as a kernel argument
    DEVICE = "device"  # read from pos[0] (CUDA-graph capture)
    SLOTS = "slots"    # read from pos[slot]; one KV ring per slot
    PAGED = "paged"    # a paged cache: block_table, seq_lens (+ query_start_loc, slot_mapping)


class QStage(StrEnum):
    F32 = "f32"
    F16 = "f16"


class KStage(StrEnum):
    SHARED_F32 = "shared_f32"  # float tile in shared memory
    REGISTERS = "registers"    # each dot lane holds its own chunk of its key
    SHARED_F16 = "shared_f16"  # __half tile in shared memory


class VStage(StrEnum):
    GLOBAL = "global"        # V read per element from global memory
    SHARED_Q4 = "shared_q4"  # the tile's raw Q4_0 V rows staged in shared


class Threads(StrEnum):
    HEAD_DIM = "head_dim"  # one thread per output dim: head_dim whole warps
    WARPS = "warps"        # head_dim rounded up to whole warps; the threads past
    #                        head_dim score keys and stage tiles but own no dim


class Schedule(StrEnum):
    BLOCK_TILE = "block_tile"    # the block scores a tile of keys together: shared
    #                              tiles, a softmax fold per tile, barriers between
    WARP_STREAM = "warp_stream"  # decode: each unit of dot_lanes lanes streams its own
    #                              keys from global memory into registers (K and V of
    #                              keys_per_step keys in flight), with its own online
    #                              softmax; the units merge once, at the end
    QUERY_TILE = "query_tile"    # prefill, FlashAttention-2 for SIMT FP32: a block owns
    #                              tile_rows query rows (with GQA, the q heads of its kv
    #                              head packed as rows), stages f32 K and V tiles of
    #                              tile_keys keys once for all of them, and computes S and
    #                              O in per-thread register micro-tiles


class Window(StrEnum):
    SINK_RECENT = "sink_recent"  # attention sinks + recent window, per 16-key tile
    EXACT = "exact"              # keys in [p - win_left, p + win_right] (and the sink
    #                              prefix), key-exact; whole tiles outside are skipped


class Mask(StrEnum):
    CAUSAL = "causal"  # query at position p sees keys j <= p
    FULL = "full"      # every key of the sequence (encoder form; prefill)


class SoftCap(StrEnum):
    NONE = "none"
    TANH = "tanh"      # s -> softcap * tanh(s / softcap) before the softmax; 0 = off


class Sinks(StrEnum):
    NONE = "none"
    LEARNED = "learned"  # one logit per q head joins the softmax denominator


class QtileLoads(StrEnum):
    SCALAR = "scalar"  # query_tile: 32-bit shared loads, keys and columns lane-strided
    VEC4 = "vec4"      # query_tile: 128-bit shared loads along head_dim (q.K) and along
    #                    keys / column quads (P.V); rows padded to whole float4s
    SWIZZLE = "swizzle"  # query_tile: 128-bit shared loads of q and K rows whose float4s
    #                      are swizzled (no pad: the q tile and a K/V tile fill the block's
    #                      shared memory), K/V tiles staged a float4 of dims at a time by
    #                      the format's quad reader, P handed between a row's lanes by
    #                      shuffles (no P tile)


class StreamSteps(StrEnum):
    SPLIT = "split"    # hoisted warp_stream decode: a step whose keys all lie in the split
    #                    and the window runs an unmasked copy of the step
    MASKED = "masked"  # every step masks (one copy of the step)


class StreamLoads(StrEnum):
    GUARDED = "guarded"  # warp_stream: a branch per key and chunk element (any head_dim
    #                      up to kreg_max_chunk * dot_lanes)
    HOISTED = "hoisted"  # warp_stream: head_dim fixed at kreg_max_chunk * dot_lanes, a
    #                      masked key read at a clamped row: every load of a step is
    #                      unconditional and in flight before the first is used


class LaneDims(StrEnum):
    STRIDED = "strided"  # hoisted warp_stream: a dot lane owns dims lane + i * dot_lanes
    QUADS = "quads"      # hoisted warp_stream: a dot lane owns float4s of dims, quad
    #                      lane + j * dot_lanes, each read by the format's quad reader (one
    #                      load of four elements) for K and V


class Prefetch(StrEnum):
    NONE = "none"            # lane_dims = quads: a step issues its own loads, then uses them;
    #                          qtile_loads = swizzle: a tile's loads, then their stores
    NEXT_STEP = "next_step"  # lane_dims = quads: a step issues the next step's loads before
    #                          it scores its own (read a step ahead, twice the K/V registers);
    #                          qtile_loads = swizzle: the next K tile's loads under P.V, a V
    #                          tile's under its S patch (a tile's quads in registers)


class KeySplit(StrEnum):
    WHOLE = "whole"        # a prefill block walks every key its query tile sees and writes
    #                        the normalised output
    PARTIALS = "partials"  # query_tile prefill: block (tile, split) walks split's even
    #                        share of its tile's key tiles and writes each row's (m, l, acc)
    #                        partial, folded by the decode combine (one head a (row, q head))


class Combine(StrEnum):
    SERIAL = "serial"  # decode_combine: a block per head, a thread per dim folding the splits
    #                    in one loop (a load, an exp and two FMAs an iteration, serially)
    STAGED = "staged"  # a warp per 32 dims of a head: it loads a chunk of 32 splits' partials
    #                    at once (the next chunk's while one folds), each split's weight
    #                    computed once and shuffled; the fold keeps the serial form's order,
    #                    so its bits


class Lse(StrEnum):
    NONE = "none"    # the merge writes the output only (the engine's output_lse = none)
    WRITE = "write"  # it also writes the merged log-sum-exp, [n_head][n_tokens]


class SeqStarts(StrEnum):
    NONE = "none"    # gather_mla_cache: each request's context starts at its row 0
    GIVEN = "given"  # gather_mla_cache: seq_starts [B] gives each request's first row


class KeySource(StrEnum):
    DENSE = "dense"  # DFlashBlockAttention: keys are the block's own rows of key / value
    PAGED = "paged"  # DFlashPagedBlockAttention: the request's paged context, then its
    #                  block's rows, as one combined key sequence


class KvReads(StrEnum):
    GLOBAL = "global"            # AttentionDenseFast: each warp reads its keys from global
    SHARED_TILE = "shared_tile"  # AttentionDenseFlash: the block's warps (one kv head)
    #                              stage each K/V tile in shared memory together, then each
    #                              folds it exactly as the global kernel would


class IoDtype(StrEnum):
    """An element type of an op's input or output tensors (dense attention's query / key /
    value or output; the MLA ops' latent rows, queries and outputs; merge_attn_states'
    outputs): a registered format whose rows are plain elements (its NumPy model and
    device helpers convert; math is f32)."""

    F32 = "f32"
    BF16 = "bf16"
    F16 = "f16"

    @property
    def fmt(self) -> KvFormat:
        return FORMATS[self.value]


class RingFloor(StrEnum):
    NONE = "none"    # the fp16 window ring is trusted for every recent key
    BATCH = "batch"  # keys lapped by later rows of the same batch fall back to the body


@dataclass(frozen=True)
class Key:
    """One settable key: its type (an Enum, int or str) and default; an int key is at
    least ``lo`` (positive unless said) and at most ``hi`` (None: no bound of its own),
    ``hi_why`` saying what bounds it. Its scope is the ops whose objects take it
    (``OpDef.spec_keys``), or every op (``every_op``: module, doc, op)."""

    type: type
    default: object
    doc: str = ""
    hi: int | None = None
    hi_why: str = ""
    lo: int = 1
    every_op: bool = False  # a key of every kernel, whatever its op
    name: str = field(default="", compare=False)  # its name in KEYS (set there)

    @property
    def ops(self) -> frozenset[Op] | None:
        """The ops that take the key (None: every op), as the op registry declared them."""
        if self.every_op:
            return None
        if not _KEY_OPS:
            raise RuntimeError("Key.ops is the op registry's: import kgen.ops first")
        return _KEY_OPS[self.name]


# Each key's ops, as the op objects declare them (``OpDef.spec_keys``). The registry
# (kgen.ops, which imports this module: this one cannot import it) hands them over.
_KEY_OPS: dict[str, frozenset[Op]] = {}


def declare_key_ops(takes: Mapping[Op, frozenset[str]]) -> None:
    """Records the keys each registered op takes (``kgen.ops`` calls it when it
    registers the ops); a key KEYS does not define is refused."""
    unknown = sorted({key for keys in takes.values() for key in keys} - KEYS.keys())
    if unknown:
        raise KeyError(f"op objects take keys KEYS does not define: {', '.join(unknown)}")
    _KEY_OPS.clear()
    _KEY_OPS.update({name: frozenset(op for op, keys in takes.items() if name in keys)
                     for name in KEYS})


# Every settable key; the ops that take it say so (their objects' ``spec_keys``).
KEYS: dict[str, Key] = {n: replace(key, name=n) for n, key in {
    "module": Key(str, None, "generated file the kernel lands in", every_op=True),
    "doc": Key(str, "", "one line saying what the kernel is for", every_op=True),
    "op": Key(Op, None, "what the kernel computes", every_op=True),
    "mode": Key(Mode, Mode.PREFILL, "prefill (query rows) or split decode"),
    "position": Key(Position, Position.HOST, "where the current position comes from"),
    "kv": Key(KvFormatName, KvFormatName("f32"), "KV-cache row format (of the K rows, and "
              "of the V rows unless v_kv says otherwise)"),
    "v_kv": Key(KvFormatName, None, "the V rows' format (default: kv's; another format "
                "makes a mixed cache: K rows kv, V rows v_kv)"),
    "q_stage": Key(QStage, QStage.F32, "element type of the staged q group"),
    "k_stage": Key(KStage, KStage.SHARED_F32, "where a K tile lives"),
    "v_stage": Key(VStage, VStage.GLOBAL, "where V rows are read from"),
    "threads": Key(Threads, Threads.HEAD_DIM, "threads of a block"),
    "schedule": Key(Schedule, Schedule.BLOCK_TILE, "how a block walks its keys"),
    "keys_per_step": Key(int, 2, "keys a warp_stream unit (dflash, dense_attention: a "
                         "warp) loads before scoring them"),
    "window": Key(Window, Window.SINK_RECENT, "which key tiles are attended"),
    "mask": Key(Mask, Mask.CAUSAL, "which keys a query sees before any window"),
    "softcap": Key(SoftCap, SoftCap.NONE, "logit soft-capping"),
    "sinks": Key(Sinks, Sinks.NONE, "learned attention-sink logits (decode: in the combine)"),
    "ring_floor": Key(RingFloor, RingFloor.NONE, "fp16 window-ring liveness"),
    "stream_loads": Key(StreamLoads, StreamLoads.GUARDED, "warp_stream: guarded "
                        "loads for any head_dim, or hoisted: one head_dim, every load "
                        "unconditional"),
    "stream_steps": Key(StreamSteps, StreamSteps.SPLIT, "hoisted warp_stream decode: "
                        "full steps run an unmasked copy of the step (split), or every step "
                        "masks (masked)"),
    "lane_dims": Key(LaneDims, LaneDims.STRIDED, "hoisted warp_stream: which dims "
                     "a dot lane owns (strided: one element a lane per dot_lanes; quads: a "
                     "float4 of dims per dot_lanes quads, read a quad a load)"),
    "prefetch": Key(Prefetch, Prefetch.NONE, "lane_dims = quads: whether a step's "
                    "K/V loads are issued a step ahead (next_step) or in the step (none); "
                    "qtile_loads = swizzle: whether a K tile's loads are issued a tile "
                    "ahead and a V tile's under its S patch (next_step) or each where it is "
                    "stored (none)"),
    "tile_keys": Key(int, 16, "keys per tile (and split rounding; dense_attention, "
                      "kv_reads = shared_tile: keys of a staged K/V tile)"),
    "dot_lanes": Key(int, 16, "lanes cooperating on one q.k dot"),
    "max_groups": Key(int, 8, "compile-time bound on kv_groups"),
    "rows_per_block": Key(int, 1, "query rows of a prefill block (K/V tiles shared)"),
    "k_pad": Key(int, 16, "floats of padding per shared K row (0: none)", lo=0),
    "kreg_max_chunk": Key(int, 16, "compile-time bound on head_dim/dot_lanes",
                          hi=TARGET.registers_per_thread,
                          hi_why="a dot lane keeps its K chunk in registers, and a thread has "
                          f"{TARGET.registers_per_thread}"),
    "v_rounds": Key(int, 3, "blockDim-strided rounds that stage the V tile"),
    "ring_rows": Key(int, 256, "rows of the fp16 window ring (it laps here)"),
    "sink_rows": Key(int, 8, "rows of the fp16 sink buffer"),
    "max_head_dim": Key(int, 1024, "static staging bound (append); the widest head_dim a "
                        "query_tile thread's output patch holds (dflash: a warp's q and "
                        "output row, in registers)"),
    "tile_rows": Key(int, 64, "query_tile: rows (query position, q head) of a "
                     "block's query tile"),
    "micro_rows": Key(int, 2, "query_tile: rows of a thread's score and output patch"),
    "micro_keys": Key(int, 4, "query_tile: keys of a thread's score patch"),
    "min_blocks": Key(int, 0, "query_tile: blocks an SM that the kernel's registers "
                      "must allow (__launch_bounds__ with the block's threads; 0: no bound): "
                      "a bound for every target the PTX is compiled for, so one whose SMs "
                      "have fewer registers than sm_37's (a driver's JIT of the PTX) keeps "
                      "that many blocks; on sm_37 (128K registers an SM) it holds a thread "
                      "under 255 registers only where min_blocks x threads x 255 exceed them",
                      lo=0),
    "qk_split": Key(int, 1, "query_tile, qtile_loads = swizzle: shares of head_dim "
                    "that S = q.K^T is split into, one a warp (1: a thread sums its patch over "
                    "every dim; the block's warps: each warp sums the whole S tile over its "
                    "share in 8 x 4 lanes, and the shares meet in shared memory)"),
    "qtile_loads": Key(QtileLoads, QtileLoads.SCALAR, "query_tile: the width of "
                       "its shared-memory loads (scalar; vec4: float4 along head_dim; "
                       "swizzle: float4 over swizzled rows, P by shuffles)"),
    "key_split": Key(KeySplit, KeySplit.WHOLE, "query_tile prefill: a block walks "
                     "all its tile's keys (whole), or one of n_splits even shares of them and "
                     "writes (m, l, acc) partials for the decode combine (partials)"),
    "combine": Key(Combine, Combine.SERIAL, "decode_combine: a thread per dim folds the "
                   "splits one load at a time (serial), or a warp per 32 dims loads 32 "
                   "splits at once (staged; the same bits)"),
    "lse": Key(Lse, Lse.NONE, "whether the (merged) log-sum-exp is written too "
               "(output_lse, lse), or not (none)"),
    "seq_starts": Key(SeqStarts, SeqStarts.NONE, "whether a request's context rows start "
                      "at seq_starts[b] (given) or at 0 (none)"),
    "key_source": Key(KeySource, KeySource.DENSE, "dflash: the block's own key rows "
                      "(dense), or the request's paged context then its block (paged)"),
    "kv_reads": Key(KvReads, KvReads.GLOBAL, "dense_attention: each warp reads K/V "
                    "from global (Fast), or a block stages K/V tiles in shared (Flash)"),
    "in_dtype": Key(IoDtype, IoDtype.F32, "element type of the input tensors "
                    "(dense_attention: query, key, value; dflash_attention: query and every "
                    "key and value row, block and context; MLA: kv_c / k_pe rows, the latent "
                    "cache, queries, prefill K and V; merge_attn_states: the two outputs "
                    "merged); math is f32"),
    "out_dtype": Key(IoDtype, IoDtype.F32, "element type of the output "
                     "(f32, or a 16-bit type rounded to nearest even); an LSE is f32"),
}.items()}


@dataclass(frozen=True)
class BuiltinSet:
    """A set a spec binds without declaring it: every registered object of an axis, in
    registration order (``for kv in formats``); ``where`` filters them by ``flags``,
    their yes/no properties (``formats where not shadows``)."""

    key: str                       # the axis whose values it holds
    members: Mapping[str, object]  # value -> its registered object
    flags: tuple[str, ...]
    doc: str


SETS: dict[str, BuiltinSet] = {
    "formats": BuiltinSet("kv", FORMATS, KvFormat.flags(), "every registered KV format"),
}


# Axes that place a kernel's loads, not its arithmetic: kernels that differ only in them
# give the same bits, so the runtime treats them as one form (a whole prefill's split
# twin, a split plan's family) and a spec may set them per form by its registers.
LOAD_PLACEMENT = ("prefetch",)

RESOURCES = ("registers", "stack_frame", "spill_stores", "spill_loads", "static_smem")
