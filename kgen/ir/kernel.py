"""The resolved kernel IR: every key settled, inheritance flattened.

Two kernels that mean the same compare equal (dataclass ``==``); where a value
came from is kept in ``origin`` and excluded from equality: for each key the spec sets,
every assignment of it along the kernel's lineage (root first), each with its place and
the definition that made it, so a diagnostic can tell the kernel's own choices from the
ones it inherits (``kgen.compiler.spec.contract``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kgen.compiler.spec.ast import ExpectRelation, ExpectResource
from kgen.errors import SourcePos
from kgen.formats import KvFormat, KvFormatName, KvPair
from kgen.ir.axes import (
    Combine,
    IoDtype,
    KeySource,
    KeySplit,
    KStage,
    KvReads,
    LaneDims,
    Lse,
    Mask,
    Mode,
    Op,
    Position,
    Prefetch,
    QStage,
    QtileLoads,
    RingFloor,
    Schedule,
    SeqStarts,
    Sinks,
    SoftCap,
    StreamLoads,
    StreamSteps,
    Threads,
    VStage,
    Window,
)


@dataclass(frozen=True)
class Setting:
    """One assignment of a key along a kernel's lineage: the value, where it was written
    (the assignment, or the family binding that set it) and the definition it is in."""

    value: object
    pos: SourcePos
    owner: str


@dataclass(frozen=True)
class Kernel:
    name: str
    module: str
    doc: str
    op: Op
    mode: Mode
    position: Position
    kv: KvFormatName
    v_kv: KvFormatName  # resolved: kv's value where the spec does not set it
    q_stage: QStage
    k_stage: KStage
    v_stage: VStage
    threads: Threads
    schedule: Schedule
    window: Window
    mask: Mask
    softcap: SoftCap
    sinks: Sinks
    ring_floor: RingFloor
    tile_keys: int
    dot_lanes: int
    max_groups: int
    rows_per_block: int
    k_pad: int
    kreg_max_chunk: int
    v_rounds: int
    ring_rows: int
    sink_rows: int
    max_head_dim: int
    keys_per_step: int
    tile_rows: int
    micro_rows: int
    micro_keys: int
    qk_split: int
    min_blocks: int
    qtile_loads: QtileLoads
    stream_loads: StreamLoads
    stream_steps: StreamSteps
    lane_dims: LaneDims
    prefetch: Prefetch
    key_split: KeySplit
    combine: Combine
    lse: Lse
    seq_starts: SeqStarts
    key_source: KeySource
    kv_reads: KvReads
    in_dtype: IoDtype
    out_dtype: IoDtype
    budgets: tuple[ExpectResource, ...] = ()
    relations: tuple[ExpectRelation, ...] = ()
    lineage: tuple[str, ...] = ()  # the kernel, its parent, ... (for `kgen show`)
    spec_path: str = field(compare=False, default="")
    pos: SourcePos = field(compare=False, default=SourcePos("<spec>", 1, 1))
    # Each key the spec sets, with its assignments along the lineage, root first: the
    # last one is the value's (``where``); the ones before, what it overrides.
    origin: tuple[tuple[str, tuple[Setting, ...]], ...] = field(compare=False, default=())

    def where(self, key: str) -> SourcePos:
        """The position of the assignment that set ``key`` (else the kernel's name)."""
        chain = self.settings(key)
        return chain[-1].pos if chain else self.pos

    def settings(self, key: str) -> tuple[Setting, ...]:
        """Every assignment of ``key`` along the lineage, root first (none: a default)."""
        return next((chain for k, chain in self.origin if k == key), ())

    @property
    def fmt(self) -> KvFormat:
        """The KV format object the ``kv`` axis names: the K rows' (their layout and
        rules; the V rows' too unless the kernel is mixed)."""
        return self.kv.fmt

    @property
    def v_fmt(self) -> KvFormat:
        """The format object of the V rows (``v_kv``)."""
        return self.v_kv.fmt

    @property
    def pair(self) -> KvPair:
        """The cache's formats as a pair: what a cache asks of K and V together."""
        return KvPair(self.kv.fmt, self.v_kv.fmt)

    @property
    def mixed(self) -> bool:
        """K and V rows of different formats."""
        return self.v_kv != self.kv

    @property
    def explicit_keys(self) -> frozenset[str]:
        return frozenset(k for k, _ in self.origin)
