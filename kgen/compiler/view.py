"""What the templates see of a kernel: its IR plus derived facts.

Derived facts (which shared regions exist, element types, the parameter list)
are computed here once, in Python, so templates only choose spellings.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kgen.ir import geometry
from kgen.ir.axes import (
    KeySource,
    KStage,
    KvReads,
    Lse,
    Mask,
    Mode,
    Position,
    Prefetch,
    QStage,
    RingFloor,
    Schedule,
    SeqStarts,
    Sinks,
    SoftCap,
    Threads,
    VStage,
    Window,
)
from kgen.ir.geometry import (
    DENSE_ROWS,
    DFLASH_ROWS,
    MERGE_ROWS,
    QK_KEY_GROUPS,
    QK_ROW_GROUPS,
    Region,
    ScoreScatter,
    dflash_chunks,
    flash_regions,
    key_partials,
    out_cols,
    p_stride,
    qk_patch,
    qtile_threads,
    row_groups,
    row_lanes,
    score_scatter,
    stream_full_steps,
    stream_hoisted,
    stream_merge_units,
    stream_quads,
    swizzle_stride,
)
from kgen.ir.kernel import Kernel
from kgen.ir.signature import Param
from kgen.ir.spellings import K_TILE_ELEM, Q_ELEM, SHARED_SYMBOL
from kgen.ops import get, params


@dataclass(frozen=True)
class Side:
    """The names one role's rows go by in a flash or append kernel: its cache array
    (``k_cache``), head pointer (``k_head``), new rows (``k_new``), per-tensor scale,
    and the per-kernel values its format's reads declare: the row's bytes and a paged
    position's stride. A kernel of one format shares those two between the roles
    (``row_bytes``, ``pstride``); a mixed kernel has one of each per role."""

    role: str        # "k" or "v"
    row_bytes: str
    pstride: str

    @property
    def cache(self) -> str:
        return f"{self.role}_cache"

    @property
    def head(self) -> str:
        return f"{self.role}_head"

    @property
    def new(self) -> str:
        return f"{self.role}_new"

    @property
    def scale(self) -> str:
        return f"{self.role}_scale"


@dataclass(frozen=True)
class KernelView:
    k: Kernel

    def __getattr__(self, name):  # the IR's fields read through
        return getattr(self.k, name)

    @cached_property
    def k_side(self) -> Side:
        return self._side("k")

    @cached_property
    def v_side(self) -> Side:
        return self._side("v")

    def _side(self, role: str) -> Side:
        if self.k.mixed:
            return Side(role, f"{role}_row_bytes", f"{role}_pstride")
        return Side(role, "row_bytes", "pstride")

    @property
    def k_sides(self) -> tuple[Side, ...]:
        """The roles the K format's file serves (its setup, head pointers, append body):
        both, unless V rows are another format's (``v_sides``)."""
        return (self.k_side,) if self.k.mixed else (self.k_side, self.v_side)

    @property
    def v_sides(self) -> tuple[Side, ...]:
        """The roles the V format's file serves: V in a mixed kernel, else none."""
        return (self.v_side,) if self.k.mixed else ()

    @cached_property
    def shared_regions(self) -> tuple[Region, ...]:
        return flash_regions(self.k)

    @cached_property
    def units(self) -> int:
        """A hoisted warp_stream kernel's units: its one head_dim fixes its block."""
        return geometry.stream_units(self.k, geometry.stream_head_dim(self.k))

    @cached_property
    def merge_units(self) -> int:
        return stream_merge_units(self.k)

    @cached_property
    def scatter(self) -> ScoreScatter:
        return score_scatter(self.k)

    @cached_property
    def params(self) -> tuple[Param, ...]:
        return params(self.k)

    @property
    def prefill(self) -> bool:
        return get(self.k.op).template_mode(self.k) is Mode.PREFILL

    @property
    def template(self) -> str:
        """The kernel template: one per op, unless the op's schedules have skeletons of
        their own (its op answers)."""
        return get(self.k.op).kernel_template(self.k)

    @property
    def stream(self) -> bool:
        return get(self.k.op).template_schedule(self.k) is Schedule.WARP_STREAM

    @property
    def hoisted(self) -> bool:
        """warp_stream with stream_loads = hoisted (see kgen.ir.geometry.stream_hoisted)."""
        return stream_hoisted(self.k)

    @property
    def lane_quads(self) -> bool:
        """A hoisted warp_stream kernel whose lanes own float4s of dims
        (kgen.ir.geometry.stream_quads)."""
        return stream_quads(self.k)

    @property
    def prefetch(self) -> bool:
        """prefetch = next_step (lane_dims = quads or qtile_loads = swizzle,
        check_schedule): loads a step (a tile) ahead."""
        return self.k.prefetch is Prefetch.NEXT_STEP

    @property
    def full_steps(self) -> bool:
        """An unmasked copy of the key step (kgen.ir.geometry.stream_full_steps)."""
        return stream_full_steps(self.k)

    @property
    def qtile(self) -> bool:
        return get(self.k.op).template_schedule(self.k) is Schedule.QUERY_TILE

    @property
    def key_partials(self) -> bool:
        """A query tile split over keys (kgen.ir.geometry.key_partials): (m, l, acc)
        partials for the decode combine instead of the output."""
        return key_partials(self.k)

    @property
    def row_lanes(self) -> int:
        return row_lanes(self.k)

    @property
    def row_groups(self) -> int:
        return row_groups(self.k)

    @property
    def out_cols(self) -> int:
        return out_cols(self.k)

    @property
    def p_stride(self) -> int:
        return p_stride(self.k)

    @property
    def swizzle_stride(self) -> int:
        return swizzle_stride(self.k)

    @property
    def block_threads(self) -> int:
        """query_tile: the block's threads (fixed by its tile shape)."""
        return qtile_threads(self.k)

    @property
    def qk_patch(self) -> tuple[int, int]:
        return qk_patch(self.k)

    @property
    def qk_lanes(self) -> tuple[int, int]:
        """qk_split > 1: a warp's lanes along the rows and along the keys."""
        return QK_ROW_GROUPS, QK_KEY_GROUPS

    @property
    def slots(self) -> bool:
        return self.k.position is Position.SLOTS

    @property
    def multi_row(self) -> bool:
        """A prefill block serves rows_per_block query rows (rows_per_block > 1)."""
        return self.k.rows_per_block > 1

    @property
    def paged(self) -> bool:
        return self.k.position is Position.PAGED

    @property
    def per_request(self) -> bool:
        """A decode over many sequences at their own lengths (slots, or paged)."""
        return get(self.k.op).template_mode(self.k) is Mode.DECODE and (
            self.k.position in (Position.SLOTS, Position.PAGED))

    @property
    def device_pos(self) -> bool:
        return self.k.position is Position.DEVICE

    @property
    def k_tile(self) -> bool:
        return self.k.k_stage is not KStage.REGISTERS

    @property
    def k_registers(self) -> bool:
        return self.k.k_stage is KStage.REGISTERS

    @property
    def k_elem(self) -> str | None:
        return K_TILE_ELEM[self.k.k_stage]

    @property
    def q_elem(self) -> str:
        return Q_ELEM[self.k.q_stage]

    @property
    def v_tile(self) -> bool:
        return self.k.v_stage is VStage.SHARED_Q4

    @property
    def batch_floor(self) -> bool:
        return self.k.ring_floor is RingFloor.BATCH

    @property
    def padded(self) -> bool:
        """The block is head_dim rounded up to whole warps (threads = warps)."""
        return self.k.threads is Threads.WARPS

    @property
    def exact_window(self) -> bool:
        return self.k.window is Window.EXACT

    @property
    def mask_full(self) -> bool:
        return self.k.mask is Mask.FULL

    @property
    def softcap_tanh(self) -> bool:
        return self.k.softcap is SoftCap.TANH

    @property
    def learned_sinks(self) -> bool:
        return self.k.sinks is Sinks.LEARNED

    @property
    def writes_lse(self) -> bool:
        """merge_attn_states: the merged LSE is written too (lse = write)."""
        return self.k.lse is Lse.WRITE

    @property
    def combine_staged(self) -> dict | None:
        """decode_combine, combine = staged: its compile-time geometry (kgen.ir.geometry,
        one home); None for the serial form."""
        g = geometry
        if not g.combine_staged(self.k):
            return None
        return {"threads": g.COMBINE_THREADS, "dims": g.COMBINE_DIMS}

    @property
    def merge_rows(self) -> int:
        """merge_attn_states: (token, head) rows of a block, a warp each."""
        return MERGE_ROWS

    @property
    def mla(self) -> dict:
        """The MLA kernels' compile-time geometry (kgen.ir.geometry, one home)."""
        g = geometry
        return {"latent": g.MLA_LATENT, "rope": g.MLA_ROPE, "row": g.MLA_ROW,
                "store_threads": g.MLA_STORE_THREADS, "gather_rows": g.MLA_GATHER_ROWS,
                "tile": g.MLA_TILE, "heads": g.MLA_HEADS, "threads": g.MLA_THREADS,
                "v_cols": g.MLA_V_COLS, "v_threads": g.MLA_V_THREADS,
                "combine_threads": g.MLA_COMBINE_THREADS, "prefill_qk": g.MLA_PREFILL_QK,
                "prefill_v": g.MLA_PREFILL_V, "prefill_rows": g.MLA_PREFILL_ROWS,
                "prefill_tile": g.MLA_PREFILL_TILE}

    @property
    def mla_row_quads(self) -> int:
        """gather_mla_cache: 16-byte quads of a latent row of in_dtype (what a lane copies)."""
        return geometry.mla_row_quads(self.k)

    @property
    def writes_mla_lse(self) -> bool:
        """mla_combine ([B][Hq]), mla_prefill ([H][total_q]): the LSE is written too."""
        return get(self.k.op).writes_mla_lse(self.k)

    @property
    def mla_causal(self) -> bool:
        """mla_prefill, mask = causal: query i sees keys j <= i + Lk - Lq."""
        return get(self.k.op).mla_causal(self.k)

    @property
    def mla_seq_starts(self) -> bool:
        """gather_mla_cache: a request's rows start at seq_starts[b] (seq_starts = given)."""
        return self.k.seq_starts is SeqStarts.GIVEN

    @property
    def paged_keys(self) -> bool:
        """dflash_attention: the paged context then the block (key_source = paged)."""
        return self.k.key_source is KeySource.PAGED

    @property
    def dflash_rows(self) -> int:
        """dflash_attention: (query row, q head) rows of a block, a warp each."""
        return DFLASH_ROWS

    @property
    def dense_tiled(self) -> bool:
        """dense_attention: K/V tiles staged in shared memory (kv_reads = shared_tile)."""
        return self.k.kv_reads is KvReads.SHARED_TILE

    @property
    def dense_rows(self) -> int:
        """dense_attention: (query row, q head) rows of a block, a warp each."""
        return DENSE_ROWS

    @property
    def dflash_chunks(self) -> int:
        """dflash_attention: dims of q and of the output a lane holds."""
        return dflash_chunks(self.k)

    @property
    def block_note(self) -> str:
        return "head_dim rounded up to whole warps" if self.padded else "head_dim threads"

    @property
    def byte_layout(self) -> bool:
        """Any __half region forces byte offsets so float regions stay aligned."""
        return self.k.q_stage is QStage.F16 or self.k.k_stage is KStage.SHARED_F16

    @property
    def shared_symbol(self) -> str:
        return SHARED_SYMBOL[(self.byte_layout, self.k_tile, self.v_tile)]

