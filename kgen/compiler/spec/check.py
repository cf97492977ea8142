"""Stage ``check``: semantic contracts on resolved kernels, in a fixed order.

Each ``check_*`` guards one contract the generated CUDA relies on and raises a
SpecError pointing at the assignment that breaks it; the message ends with the
contract's name, e.g. ``[check_register_k]``. ``CHECKS`` is the order.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from kgen.compiler.spec.ast import Assign, KernelDef, SpecFile
from kgen.compiler.spec.names import kernel_name_problem, module_name_problem
from kgen.errors import SourcePos, SpecError, did_you_mean
from kgen.ir.axes import (
    KEYS,
    RESOURCES,
    KeySplit,
    KStage,
    LaneDims,
    Mask,
    Mode,
    Op,
    Position,
    Prefetch,
    QStage,
    RingFloor,
    Schedule,
    Sinks,
    VStage,
)
from kgen.ir.geometry import (
    QK_KEY_GROUPS,
    QK_ROW_GROUPS,
    accumulators,
    dense_shared_bytes,
    dflash_chunks,
    dflash_held_floats,
    flash_shared_bytes,
    max_head_dim_launched,
    min_head_dim,
    padded,
    qk_patch,
    qtile_swizzle,
    qtile_threads,
    qtile_vec4,
    query_tiles,
    register_k_floats,
    row_groups,
    row_lanes,
    stream_head_dim,
    stream_hoisted,
    stream_quads,
    streams,
    swizzle_stride,
    tile_threads,
)
from kgen.ir.kernel import Kernel
from kgen.ir.target import TARGET

Lines = dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class ModuleClaim:
    """A module as the first kernel of it that the checks met: its spelling, where
    that kernel set it, and the spec file of that kernel."""

    module: str
    pos: SourcePos
    path: str


def _module_assign(d: KernelDef, defs: Mapping[str, KernelDef]) -> Assign | None:
    """The ``module = ...`` a definition has, its own or its nearest ancestor's among
    ``defs`` (None where the chain leaves them, loops or sets none)."""
    seen: set[str] = set()
    while d is not None and d.name not in seen:
        seen.add(d.name)
        own = next((a for a in d.assigns if a.key == "module"), None)
        if own is not None:
            return own
        d = defs.get(d.parent) if d.parent else None
    return None


@dataclass(frozen=True)
class Beside:
    """The rest of a spec set, beside the files checked (``kgen check FILE``): what
    the rules that span a set's files need of it, read from the definitions alone
    (a file beside may be broken where FILE does not reach it): every definition's
    name, the concrete kernels' names (names of the kgen_kernels package) and each
    one's module."""

    names: Mapping[str, SourcePos] = field(default_factory=dict)
    kernels: frozenset[str] = frozenset()
    modules: Mapping[str, ModuleClaim] = field(default_factory=dict)  # lowercased

    @classmethod
    def of(cls, files: Sequence[SpecFile]) -> Beside:
        defs = {d.name: d for f in files for d in f.kernels}
        modules: dict[str, ModuleClaim] = {}
        for d in defs.values():
            a = None if d.abstract else _module_assign(d, defs)
            if a is not None and isinstance(a.value, str):
                modules.setdefault(a.value.lower(), ModuleClaim(a.value, a.pos, d.pos.path))
        return cls({n: d.pos for n, d in defs.items()},
                   frozenset(n for n, d in defs.items() if not d.abstract), modules)


def check_names_beside(files: Sequence[SpecFile], beside: Beside, lines: Lines) -> None:
    """A kernel name is defined once in a spec set: a definition of a checked file
    whose name a file beside it defines is refused at the checked file's line."""
    for f in files:
        for d in f.kernels:
            first = beside.names.get(d.name)
            if first is not None:
                src = lines.get(d.pos.path, ())
                raise SpecError(d.pos, f"kernel '{d.name}' is defined twice (first at "
                                f"{first})", src[d.pos.line - 1] if 0 < d.pos.line <= len(src)
                                else None)


class _Ctx:
    def __init__(self, kernels: list[Kernel], lines: Lines, named: Collection[str] | None,
                 named_defs: Mapping[str, SourcePos], beside: Beside):
        self.kernels = kernels
        self.by_name = {k.name: k for k in kernels}
        self.lines = lines
        self.named = None if named is None else frozenset(named)
        self.named_defs = named_defs
        self.beside = beside
        self.contract = ""  # the check_* running now; its name ends every message
        self.current: Kernel | None = None  # the kernel being checked now
        # Module name, lowercased -> the first kernel of it (the set beside first).
        self.modules: dict[str, ModuleClaim] = dict(beside.modules)

    def _anchor(self, k: Kernel) -> tuple[str, SourcePos] | None:
        """Why a kernel of a file beside the checked ones is checked (how it leans on
        one of their definitions), and that definition's position."""
        parent = next((n for n in k.lineage[1:] if n in self.named_defs), None)
        if parent is not None:
            return f"inherits from '{parent}'", self.named_defs[parent]
        other = next((r.other for r in k.relations if r.other in self.named_defs), None)
        if other is not None:
            return f"is related to '{other}'", self.named_defs[other]
        return None

    def error(self, pos: SourcePos, msg: str, culprit: Kernel | None = None) -> SpecError:
        """At ``pos``; but a kernel beside the checked files that one of their
        definitions breaks is reported at that definition (``culprit``, else the
        nearest of its ancestors there), naming where the broken line is."""
        k = self.current
        if (self.named is not None and k is not None and k.spec_path not in self.named
                and pos.path not in self.named):
            anchor = ((f"is related to '{culprit.name}'", culprit.pos)
                      if culprit is not None and culprit.spec_path in self.named
                      else self._anchor(k))
            if anchor is not None:
                msg += f" (at {pos}, in '{k.name}', which {anchor[0]})"
                pos = anchor[1]
        src = self.lines.get(pos.path, ())
        if self.contract:
            msg += f" [{self.contract}]"
        return SpecError(pos, msg, src[pos.line - 1] if 0 < pos.line <= len(src) else None)


def check_keys_apply_to_op(k: Kernel, ctx: _Ctx) -> None:
    """A key set on a kernel must mean something for its op."""
    for key in sorted(k.explicit_keys):
        scope = KEYS[key].ops
        if scope is not None and k.op not in scope:
            ops = ", ".join(sorted(o.value for o in scope))
            raise ctx.error(k.where(key), f"'{key}' does not apply to op={k.op.value} "
                            f"(only to op={ops})")


def check_kernel_name(k: Kernel, ctx: _Ctx) -> None:
    """The name is a C symbol, a PTX entry, a Python function and part of test names."""
    why = kernel_name_problem(k.name)
    if why is not None:
        raise ctx.error(k.pos, f"kernel name '{k.name}' {why}")


def _here(k: Kernel, key: str) -> SourcePos:
    """Where ``k``'s own file set ``key``; else the kernel (it inherits the value from
    a parent in another file: the choice is the kernel's)."""
    pos = k.where(key)
    return pos if pos.path == k.pos.path else k.pos


def check_module_name(k: Kernel, ctx: _Ctx) -> None:
    """The module names generated files, a Python module and a C identifier: an ASCII
    identifier, unique ignoring case, not a kernel's name; and its kernels are defined
    in one spec file, so that building a file writes whole modules."""
    why = module_name_problem(k.module)
    if why is not None:
        raise ctx.error(k.where("module"), f"module {k.module!r} {why}")
    if k.module in ctx.by_name or k.module in ctx.beside.kernels:
        raise ctx.error(_here(k, "module"), f"module '{k.module}' has the name of a kernel "
                        f"(both are names of the kgen_kernels package)")
    named = ctx.beside.modules.get(k.name.lower())
    if named is not None and named.module == k.name:
        raise ctx.error(k.pos, f"kernel name '{k.name}' is the name of module '{k.name}' "
                        f"({named.pos}) (both are names of the kgen_kernels package)")
    first = ctx.modules.setdefault(k.module.lower(),
                                   ModuleClaim(k.module, k.where("module"), k.spec_path))
    if first.module != k.module:
        raise ctx.error(_here(k, "module"), f"module '{k.module}' differs from module "
                        f"'{first.module}' ({first.pos}) only in case (the C header and "
                        "case-insensitive file systems would mix them up)")
    if first.path != k.spec_path:
        raise ctx.error(_here(k, "module"), f"module '{k.module}' is a module of "
                        f"{first.path} (set at {first.pos}): a module's kernels are defined "
                        "in one spec file, so that building a file writes whole modules")


def check_doc_comment(k: Kernel, ctx: _Ctx) -> None:
    """The doc lands inside a ``/* ... */`` comment, a Python comment and a docstring:
    one line of printable text (backslashes are escaped where they land)."""
    if "*/" in k.doc:
        raise ctx.error(k.where("doc"), "doc must not contain '*/' (it is emitted inside "
                        "a C comment)")
    bad = next((c for c in k.doc if not c.isprintable()), None)
    if bad is not None:
        raise ctx.error(k.where("doc"), f"doc must be one line of printable text, not "
                        f"{bad!r} (it is emitted in C and Python comments and a docstring)")


def _kv_said(k: Kernel) -> str:
    """The kernel's cache formats as its spec says them: ``kv = q8_0``, or
    ``kv = q8_0, v_kv = q4`` for a mixed cache."""
    return f"kv = {k.kv.value}" + (f", v_kv = {k.v_kv.value}" if k.mixed else "")


def _shadow_key(k: Kernel) -> str:
    """The key that brought fp16 shadows into the cache: kv, else v_kv."""
    return "kv" if k.fmt.shadows or not k.v_fmt.shadows else "v_kv"


def check_limits(k: Kernel, ctx: _Ctx) -> None:
    """Compile-time bounds with a legal launch, and not beyond what the target can use:
    append staging holds a row of at least one format block and at most a block's
    threads; the fp16 shadows' rows stay addressable (``TARGET.max_shadow_rows``)."""
    if k.op is Op.KV_APPEND:
        fmt, hd = k.pair, k.max_head_dim
        if hd > TARGET.max_threads:
            raise ctx.error(k.where("max_head_dim"), f"max_head_dim = {hd}: an append block "
                            f"is head_dim threads, at most {TARGET.max_threads}")
        if fmt.append_staging and hd < fmt.block:
            raise ctx.error(k.where("max_head_dim"), f"max_head_dim = {hd} admits no "
                            f"head_dim: a {_kv_said(k)} row is whole blocks of {fmt.block} "
                            f"values (max_head_dim >= {fmt.block})")
    if k.op in (Op.FLASH, Op.KV_APPEND):
        for key in ("sink_rows", "ring_rows"):
            rows = getattr(k, key)
            if rows > TARGET.max_shadow_rows:
                raise ctx.error(k.where(key), f"{key} = {rows} exceeds "
                                f"{TARGET.max_shadow_rows} (a head's fp16 shadow rows are "
                                "addressed with int offsets)")


def check_mode_position(k: Kernel, ctx: _Ctx) -> None:
    """Prefill reads pos0 from the host (or a varlen batch from a paged cache's
    index tensors); combine has no per-slot or paged form; a paged cache keeps no
    per-sequence fp16 shadows."""
    if (k.op is Op.FLASH and k.mode is Mode.PREFILL
            and k.position not in (Position.HOST, Position.PAGED)):
        raise ctx.error(k.where("position"), "prefill takes its position from the host "
                        "(position = host) or a paged varlen batch (position = paged); "
                        "device/slots positions are decode modes")
    if k.op is Op.DECODE_COMBINE and k.position in (Position.SLOTS, Position.PAGED):
        raise ctx.error(k.where("position"), f"combine has no {k.position.value} form: those "
                        "partials are merged by the host-position combine over every "
                        "request's heads (n_splits = the launch width)")
    if k.position is Position.PAGED and k.pair.shadows:
        raise ctx.error(k.where(_shadow_key(k)), f"a paged cache keeps no per-sequence fp16 "
                        f"shadows: {_kv_said(k)} needs them")


def check_attention_options(k: Kernel, ctx: _Ctx) -> None:
    """A full (non-causal) mask is a prefill form (a decode query is the last
    position); a split decode leaves learned sinks to its combine, which sees the
    whole denominator."""
    if k.op is not Op.FLASH or k.mode is Mode.PREFILL:
        return
    if k.mask is Mask.FULL:
        raise ctx.error(k.where("mask"), "mask = full needs mode = prefill (a decode query "
                        "is the last position: it sees every key already)")
    if k.sinks is Sinks.LEARNED:
        raise ctx.error(k.where("sinks"), "a split decode kernel cannot add the sinks (each "
                        "split sees part of the denominator): set sinks = learned on the "
                        "decode_combine kernel")


def check_rows_per_block(k: Kernel, ctx: _Ctx) -> None:
    """Several query rows per block share each staged K/V tile: a causal prefill over
    a contiguous cache whose rows all read the same values (no fp16 shadows: which
    shadow a key comes from depends on the row) with the tile-granular window, and
    one fold thread per (row, head) inside the first warp."""
    if k.op is not Op.FLASH or k.rows_per_block == 1:
        return
    where = k.where("rows_per_block")
    if k.mode is not Mode.PREFILL or k.position is not Position.HOST:
        raise ctx.error(where, "rows_per_block > 1 needs a contiguous prefill (mode = "
                        "prefill, position = host)")
    if k.pair.shadows:
        raise ctx.error(where, f"rows_per_block > 1: {_kv_said(k)} picks a key's fp16 "
                        "shadow by the row's position, so rows cannot share a K tile")
    other = [key for key in ("window", "mask", "softcap", "sinks", "v_stage")
             if getattr(k, key) != KEYS[key].default]
    if other:
        raise ctx.error(_blame(k, "rows_per_block", *other), "rows_per_block > 1 does not "
                        "combine with " + ", ".join(f"{key} = {getattr(k, key).value}"
                                                    for key in other)
                        + " yet (not supported yet: the multi-row prefill has the plain "
                        "options only)")
    if k.max_groups * k.rows_per_block > TARGET.warp:
        raise ctx.error(where, f"rows_per_block * max_groups = "
                        f"{k.max_groups * k.rows_per_block} > {TARGET.warp}: the fold runs one "
                        "thread per (row, head) inside the first warp")


def _blame(k: Kernel, *keys: str):
    """Where a combination of ``keys`` was chosen: the assignment the kernel's own
    definition makes (the latest one), else the first key's, wherever it was set (an
    inherited combination that the kernel itself changed is the kernel's line, not the
    parent's in another file)."""
    spots = [k.where(key) for key in keys]
    own = [p for p in spots if p.path == k.pos.path and p.line >= k.pos.line]
    return max(own, key=lambda p: (p.line, p.col)) if own else spots[0]


def check_schedule(k: Kernel, ctx: _Ctx) -> None:
    """warp_stream runs over one contiguous sequence (a split decode at a host or
    device position, or a prefill row per block), its units reading K straight into
    registers and V from global memory; keys_per_step bounds the keys (and
    registers) a unit has in flight. query_tile is a contiguous prefill over a cache
    whose keys read the same for every row, with f32 tiles of a shape that fits a
    block (_check_query_tile); its shape keys mean nothing to the other schedules."""
    if k.op is not Op.FLASH:
        return
    if k.schedule is not Schedule.QUERY_TILE:
        for key in QUERY_TILE_KEYS:
            if key in k.explicit_keys:
                raise ctx.error(k.where(key), f"{key} applies to a flash kernel of schedule = "
                                "query_tile only")
    if k.schedule is Schedule.QUERY_TILE:
        for key in STREAM_KEYS:
            if key in k.explicit_keys and key not in QUERY_TILE_STREAM_KEYS:
                raise ctx.error(k.where(key), f"{key} applies to schedule = warp_stream only")
        _check_query_tile(k, ctx)
        return
    if k.schedule is not Schedule.WARP_STREAM:
        for key in STREAM_KEYS:
            if key in k.explicit_keys:
                raise ctx.error(k.where(key), f"{key} applies to schedule = warp_stream only")
        return
    where = k.where("schedule")
    per_request = (Position.SLOTS, Position.PAGED) if k.mode is Mode.DECODE else ()
    if k.position not in (Position.HOST, Position.DEVICE, *per_request):
        where = _blame(k, "schedule", "position")
        raise ctx.error(where, "schedule = warp_stream prefill reads one contiguous sequence "
                        "from a host or device position (position = host or device); its "
                        "paged and per-slot forms are decode only")
    if k.rows_per_block != 1:
        raise ctx.error(k.where("rows_per_block"), "schedule = warp_stream serves one query "
                        "row per block (rows_per_block = 1)")
    if k.k_stage is not KStage.REGISTERS or k.v_stage is not VStage.GLOBAL:
        raise ctx.error(where, "schedule = warp_stream reads K into registers and V from "
                        "global memory (k_stage = registers, v_stage = global)")
    if stream_hoisted(k):
        hd = stream_head_dim(k)
        # A head_dim of part of a warp runs in a block padded to whole warps (threads =
        # warps): the threads past head_dim stream keys and own no output dim.
        if (hd % TARGET.warp and not padded(k)) or not k.pair.accepts_head_dim(hd):
            raise ctx.error(k.where("stream_loads"), f"stream_loads = hoisted serves head_dim "
                            f"= kreg_max_chunk * dot_lanes = {hd} only: it must be whole warps "
                            f"(a multiple of {TARGET.warp}, or a block of threads = warps) and "
                            f"whole {k.pair.name} blocks")
    if k.lane_dims is LaneDims.QUADS:
        _check_lane_quads(k, ctx)
    elif k.prefetch is not Prefetch.NONE:
        raise ctx.error(_blame(k, "prefetch", "lane_dims"), f"prefetch = {k.prefetch.value} "
                        "needs lane_dims = quads (the quad loads are what run a step ahead)")
    if not 1 <= k.keys_per_step <= 8:
        raise ctx.error(k.where("keys_per_step"), f"keys_per_step = {k.keys_per_step}: "
                        "1 to 8 keys per unit in flight (each holds a K and a V chunk in "
                        "registers)")


# The keys only a warp_stream kernel reads, and those of them a query_tile kernel reads
# too (the swizzled tile's prefetch).
STREAM_KEYS = ("keys_per_step", "stream_loads", "stream_steps", "lane_dims", "prefetch")
QUERY_TILE_STREAM_KEYS = ("prefetch",)


def _check_lane_quads(k: Kernel, ctx: _Ctx) -> None:
    """lane_dims = quads: a lane's dims are whole float4s at compile-time places (one
    head_dim: stream_loads = hoisted; kreg_max_chunk a multiple of 4), q read a float4 a
    load (q_stage = f32), K and V by the formats' quad readers (a format with fp16
    window shadows picks a key's row there by the block's one query row)."""
    if not stream_hoisted(k):
        raise ctx.error(_blame(k, "lane_dims", "stream_loads"), "lane_dims = quads needs "
                        "stream_loads = hoisted (one head_dim: a lane's quads at "
                        "compile-time places)")
    if k.kreg_max_chunk % 4:
        raise ctx.error(_blame(k, "lane_dims", "kreg_max_chunk"), f"lane_dims = quads: a "
                        f"lane's kreg_max_chunk = {k.kreg_max_chunk} dims must be whole float4s "
                        "(a multiple of 4)")
    if k.q_stage is not QStage.F32:
        raise ctx.error(_blame(k, "lane_dims", "q_stage"), "lane_dims = quads reads the q "
                        "group a float4 at a time: q_stage = f32")


# The keys only a query_tile kernel reads (the tile shape and the head_dim bound of a
# thread's output patch); max_head_dim is also the append kernels' staging bound.
QUERY_TILE_KEYS = ("tile_rows", "micro_rows", "micro_keys", "max_head_dim", "qtile_loads",
                   "key_split", "qk_split", "min_blocks")
# Options a query_tile kernel with vec4 loads does not have yet (none of the engine's;
# the scalar and swizzled tiles have them all), and the staging axes it fixes itself.
QUERY_TILE_VEC4_NOT_YET = ("window", "softcap", "sinks")
QUERY_TILE_FIXED = ("q_stage", "k_stage", "v_stage", "threads", "rows_per_block")
QUERY_TILE_MAX_ACCUMULATORS = 128  # output floats a thread keeps in registers


def _check_query_tile(k: Kernel, ctx: _Ctx) -> None:
    """schedule = query_tile: a prefill, of a contiguous sequence (position = host) or
    a paged varlen batch (position = paged, scalar loads); fp16 shadows (which a row
    picks by its own position) with swizzled loads only, each tile in two passes, its
    loads in place (prefetch = none); either mask, the tile-granular or the key-exact
    window, soft-cap and learned sinks (with scalar loads; vec4 loads the tile-granular
    window only); f32 tiles in shared memory (the staging axes at their defaults);
    micro-tiles that
    divide the tile, a row's lanes inside one warp (its max and sum reduce by
    shuffles), whole warps, an output patch that fits the registers, and min_blocks
    blocks that fit an SM's threads."""
    where = k.where("schedule")
    if k.mode is not Mode.PREFILL or k.position not in (Position.HOST, Position.PAGED):
        raise ctx.error(where, "schedule = query_tile "
                        "serves a prefill only (mode = prefill, position = host or paged); "
                        "its decode forms are not supported yet")
    if k.position is Position.PAGED and qtile_vec4(k):
        raise ctx.error(_blame(k, "qtile_loads", "position"), "schedule = query_tile over "
                        "pages (position = paged) has scalar or swizzled loads only "
                        "(qtile_loads = scalar or swizzle) yet")
    if k.pair.shadows and not qtile_swizzle(k):
        raise ctx.error(_blame(k, _shadow_key(k), "qtile_loads"), f"schedule = query_tile "
                        f"with {_kv_said(k)}: a key's fp16 shadow (sink rows, window ring) "
                        "depends on the row's position, which only the swizzled tile "
                        "(qtile_loads = swizzle) serves, a tile in two passes")
    if k.pair.shadows and k.prefetch is not Prefetch.NONE:
        raise ctx.error(_blame(k, "prefetch", _shadow_key(k)), f"prefetch = "
                        f"{k.prefetch.value} with {_kv_said(k)}: a tile of fp16 shadows runs "
                        "in two passes, each loading its keys in place (prefetch = none)")
    for key in QUERY_TILE_VEC4_NOT_YET if qtile_vec4(k) else ():
        if getattr(k, key) != KEYS[key].default:
            raise ctx.error(k.where(key), f"schedule = query_tile with qtile_loads = vec4 "
                            f"does not combine with {key} = {getattr(k, key).value} yet")
    for key in QUERY_TILE_FIXED:
        default = KEYS[key].default
        if getattr(k, key) != default:
            raise ctx.error(k.where(key), f"schedule = query_tile stages q, K and V as f32 "
                            f"tiles in shared memory and sizes its own block: {key} keeps "
                            f"its default ({getattr(default, 'value', default)})")
    for whole, part in (("tile_rows", "micro_rows"), ("tile_keys", "micro_keys")):
        if getattr(k, whole) % getattr(k, part):
            raise ctx.error(k.where(part), f"{part} = {getattr(k, part)} must divide "
                            f"{whole} = {getattr(k, whole)} (a thread's patch of the tile)")
    lanes = row_lanes(k)
    if lanes & (lanes - 1) or lanes > TARGET.warp:
        raise ctx.error(k.where("micro_keys"), f"tile_keys / micro_keys = {lanes} lanes share "
                        f"a row: a power of two no larger than the warp ({TARGET.warp}), so a "
                        "row's max and sum reduce by shuffles inside one warp")
    threads = qtile_threads(k)
    if threads % TARGET.warp or not TARGET.fits_block(threads):
        raise ctx.error(k.where("tile_rows"), f"(tile_rows / micro_rows) * (tile_keys / "
                        f"micro_keys) = {threads} threads: a block of whole warps, at most "
                        f"{TARGET.max_threads}")
    if k.max_head_dim < k.pair.block:
        raise ctx.error(k.where("max_head_dim"), f"max_head_dim = {k.max_head_dim} admits no "
                        f"head_dim: a {_kv_said(k)} row is whole blocks of "
                        f"{k.pair.block} values")
    if qtile_swizzle(k):
        _check_swizzle(k, ctx)
    elif k.prefetch is not Prefetch.NONE:
        raise ctx.error(_blame(k, "prefetch", "qtile_loads"), f"prefetch = "
                        f"{k.prefetch.value} on a query tile needs qtile_loads = swizzle (the "
                        "format's raw quad loads are what run a tile ahead)")
    if k.qk_split != 1:
        _check_qk_split(k, ctx)
    if k.min_blocks * threads > TARGET.threads_per_sm or k.min_blocks > TARGET.blocks_per_sm:
        raise ctx.error(k.where("min_blocks"), f"min_blocks = {k.min_blocks} blocks of "
                        f"{threads} threads: an SM holds {TARGET.threads_per_sm} threads and "
                        f"{TARGET.blocks_per_sm} blocks")
    if k.key_split is KeySplit.PARTIALS:
        _check_key_split(k, ctx)
    if qtile_vec4(k) and (k.k_pad % 4 or k.tile_keys % 4):
        raise ctx.error(k.where("qtile_loads"), f"qtile_loads = vec4 reads float4s: k_pad = "
                        f"{k.k_pad} and tile_keys = {k.tile_keys} must be multiples of 4 (rows "
                        "of the q, K/V and P tiles 16-byte aligned)")
    if accumulators(k) > QUERY_TILE_MAX_ACCUMULATORS:
        raise ctx.error(k.where("max_head_dim"), f"micro_rows * max_head_dim / {lanes} lanes "
                        f"= {accumulators(k)} output floats a thread: at most "
                        f"{QUERY_TILE_MAX_ACCUMULATORS} stay in sm_37's registers (lower "
                        "max_head_dim or micro_rows)")
    patch = k.micro_rows * k.micro_keys
    if accumulators(k) + patch > TARGET.registers_per_thread:
        raise ctx.error(_blame(k, "micro_rows", "micro_keys"), f"micro_rows * micro_keys = "
                        f"{patch} scores and {accumulators(k)} output floats a thread keeps in "
                        f"registers: {accumulators(k) + patch}, and a thread has "
                        f"{TARGET.registers_per_thread}")



# qtile_loads = swizzle: a thread xors its float4 index with its rows' (and keys') row
# index mod this, once per dim step for all of them.
SWIZZLE_ROWS = 8


def _check_swizzle(k: Kernel, ctx: _Ctx) -> None:
    """qtile_loads = swizzle: rows carry no pad (k_pad = 0: the swizzle spreads them
    over the banks), and a thread's rows (ty + i * row_groups) and keys (tx + j *
    row_lanes) share one row index mod 8, so one xor serves all of its loads of a dim
    step: row_groups and row_lanes whole multiples of 8 (or a single key a lane)."""
    if k.k_pad != 0:
        raise ctx.error(k.where("k_pad"), f"qtile_loads = swizzle permutes each row's "
                        f"float4s instead of padding rows: k_pad = {k.k_pad} must be 0")
    if row_groups(k) % SWIZZLE_ROWS:
        raise ctx.error(_blame(k, "micro_rows", "tile_rows"), f"qtile_loads = swizzle: "
                        f"tile_rows / micro_rows = {row_groups(k)} row groups must be a "
                        f"multiple of {SWIZZLE_ROWS} (a thread's rows share one swizzle)")
    if row_lanes(k) % SWIZZLE_ROWS and k.micro_keys > 1:
        raise ctx.error(_blame(k, "micro_keys", "tile_keys"), f"qtile_loads = swizzle: "
                        f"tile_keys / micro_keys = {row_lanes(k)} lanes a row must be a "
                        f"multiple of {SWIZZLE_ROWS} (a thread's keys share one swizzle)")


def _check_qk_split(k: Kernel, ctx: _Ctx) -> None:
    """qk_split > 1: the swizzled query tile (its q and K rows) with one share of head_dim
    a warp, the shares in whole swizzle groups; a warp's 8 x 4 lanes divide the tile
    and land on the thread patches (row_groups a multiple of 8, row_lanes of 4); the
    warps' partial scores fit in the K tile they replace; a lane's patch of them fits
    its registers beside its output floats."""
    where = k.where("qk_split")
    if not qtile_swizzle(k):
        raise ctx.error(_blame(k, "qk_split", "qtile_loads"), "qk_split splits the swizzled "
                        "query tile's S (qtile_loads = swizzle) only")
    warps = qtile_threads(k) // TARGET.warp
    if k.qk_split != warps:
        raise ctx.error(where, f"qk_split = {k.qk_split}: one share of head_dim a warp, and "
                        f"the block has {warps} (qk_split = 1 or {warps})")
    quads = swizzle_stride(k) // 4
    if quads % (k.qk_split * SWIZZLE_ROWS):
        raise ctx.error(where, f"qk_split = {k.qk_split} shares of {quads} float4s a row: "
                        f"each must be whole swizzle groups of {SWIZZLE_ROWS} (raise "
                        "max_head_dim)")
    if row_groups(k) % QK_ROW_GROUPS or row_lanes(k) % QK_KEY_GROUPS:
        raise ctx.error(_blame(k, "qk_split", "tile_rows"), f"qk_split: a warp's "
                        f"{QK_ROW_GROUPS} x {QK_KEY_GROUPS} lanes land on the thread patches: "
                        f"the row groups ({row_groups(k)}) a multiple of {QK_ROW_GROUPS}, a "
                        f"row's lanes ({row_lanes(k)}) of {QK_KEY_GROUPS}")
    if k.qk_split * k.tile_rows > swizzle_stride(k):
        raise ctx.error(where, f"qk_split = {k.qk_split}: the warps' partial scores "
                        f"({k.qk_split} x {k.tile_rows} x {k.tile_keys} floats) must fit in "
                        f"the K tile they replace ({k.tile_keys} x {swizzle_stride(k)})")
    rows, keys = qk_patch(k)
    if accumulators(k) + rows * keys > TARGET.registers_per_thread:
        raise ctx.error(where, f"qk_split: a lane's {rows} x {keys} partial scores and "
                        f"{accumulators(k)} output floats in registers: "
                        f"{accumulators(k) + rows * keys}, and a thread has "
                        f"{TARGET.registers_per_thread}")


def _check_key_split(k: Kernel, ctx: _Ctx) -> None:
    """key_split = partials: the swizzled query tile (qtile_loads = swizzle) writes each
    row's (m, l, acc) for the decode combine."""
    if not qtile_swizzle(k):
        raise ctx.error(_blame(k, "key_split", "qtile_loads"), "key_split = partials splits "
                        "the swizzled query tile (qtile_loads = swizzle) only")


def check_ring_floor(k: Kernel, ctx: _Ctx) -> None:
    """The batch live floor exists only for fp16 window shadows read by a batched prefill."""
    if k.op is Op.FLASH and k.ring_floor is RingFloor.BATCH:
        if not k.pair.shadows:
            raise ctx.error(k.where("ring_floor"), f"ring_floor = batch needs a format with "
                            f"an fp16 window ring; {_kv_said(k)} has none")
        if k.mode is not Mode.PREFILL:
            raise ctx.error(k.where("ring_floor"), "ring_floor = batch needs mode = prefill "
                            "(the floor is derived from the batch's last row)")


def check_dot_shape(k: Kernel, ctx: _Ctx) -> None:
    """Dot lanes reduce by shuffles within a warp; a tile must fit one block."""
    if k.op is not Op.FLASH:
        return
    lanes = k.dot_lanes
    if lanes & (lanes - 1) or lanes > TARGET.warp:
        raise ctx.error(k.where("dot_lanes"), f"dot_lanes = {lanes}: the shuffle reduction "
                        f"needs a power of two no larger than the warp ({TARGET.warp})")
    if tile_threads(k) > TARGET.max_threads:
        raise ctx.error(k.where("tile_keys"), f"tile_keys * dot_lanes = {tile_threads(k)} "
                        f"threads exceeds a block ({TARGET.max_threads}); every key of a tile "
                        "needs its own dot lanes")
    if k.tile_keys & (k.tile_keys - 1):
        raise ctx.error(k.where("tile_keys"), f"tile_keys = {k.tile_keys} must be a power of "
                        "two (the split plan rounds split lengths with a mask)")
    if k.max_groups > TARGET.warp and not query_tiles(k):
        # A query tile packs (query, q head) rows: no fold or array of it is sized by the
        # group count, so its bound is the spec's alone.
        raise ctx.error(k.where("max_groups"), f"max_groups > {TARGET.warp}: the softmax fold "
                        "runs one thread per head inside the first warp")


def check_register_k(k: Kernel, ctx: _Ctx) -> None:
    """Register K: the chunk bound must cover the smallest legal head_dim, and a
    format's lane dequant may fix the lanes and the chunk multiple (e.g. 16 lanes
    onto a 32-element block, two chunks a block)."""
    if k.op is not Op.FLASH or k.k_stage is not KStage.REGISTERS:
        return
    need = -(-min_head_dim(k) // k.dot_lanes)
    if k.kreg_max_chunk < need:
        raise ctx.error(k.where("kreg_max_chunk"), f"register K: kreg_max_chunk = "
                        f"{k.kreg_max_chunk} must be >= {need}, head_dim / dot_lanes at the "
                        f"smallest head_dim a block runs with ({min_head_dim(k)})")
    fmt = k.fmt
    # The format's lane dequant's layout (lane_dims = quads reads through its quad reader)
    lanes, multiple = ((None, 1) if stream_quads(k) else
                       (fmt.register_k_lanes, fmt.register_k_chunk_multiple))
    if lanes is not None and k.dot_lanes != lanes:
        raise ctx.error(k.where("dot_lanes"), f"register K over {fmt.name} needs dot_lanes = "
                        f"{lanes} (the format's lane dequant is laid out for it)")
    if k.kreg_max_chunk % multiple:
        raise ctx.error(k.where("kreg_max_chunk"), f"register K over {fmt.name} needs "
                        f"kreg_max_chunk a multiple of {multiple} (one scale serves that "
                        "many chunks)")
    widest = max_head_dim_launched(k)
    most = -(-widest // k.dot_lanes)
    most = -(-most // multiple) * multiple
    if k.kreg_max_chunk > most:
        raise ctx.error(k.where("kreg_max_chunk"), f"register K: kreg_max_chunk = "
                        f"{k.kreg_max_chunk} exceeds {most}, head_dim / dot_lanes at the widest "
                        f"head_dim a block runs with ({widest}: at most {TARGET.max_threads} "
                        "threads)")
    floats = register_k_floats(k)
    if streams(k) and floats > TARGET.registers_per_thread:
        raise ctx.error(_blame(k, "kreg_max_chunk", "max_groups", "keys_per_step"),
                        "register K: (max_groups + 2 * keys_per_step) * "
                        f"kreg_max_chunk = ({k.max_groups} + 2 * {k.keys_per_step}) * "
                        f"{k.kreg_max_chunk} = {floats} floats a warp_stream thread keeps in "
                        f"registers (its accumulators and the K and V chunks in flight); a "
                        f"thread has {TARGET.registers_per_thread}")


def check_shared_v(k: Kernel, ctx: _Ctx) -> None:
    """The shared-V tile stages raw rows at head_dim = tile_keys * dot_lanes as
    whole 32-bit words, in exactly v_rounds blockDim-strided rounds."""
    if k.op is not Op.FLASH or k.v_stage is not VStage.SHARED_Q4:
        return
    fmt = k.v_fmt  # the V rows' format stages its raw rows
    if not fmt.raw_v_tile:
        said = "v_kv" if k.mixed else "kv"
        raise ctx.error(k.where("v_stage"), f"v_stage = {k.v_stage.value}: {said} = "
                        f"{fmt.name} has no raw V tile reader")
    head_dim = tile_threads(k)
    if not fmt.accepts_head_dim(head_dim):
        raise ctx.error(k.where("tile_keys"), f"shared-V pins head_dim = tile_keys * "
                        f"dot_lanes = {head_dim}, not a whole number of {fmt.name} blocks")
    row_bytes = fmt.row_bytes(head_dim)
    tile_bytes = k.tile_keys * row_bytes
    if tile_bytes % 4:
        raise ctx.error(k.where("v_stage"), f"the shared-V tile ({tile_bytes} bytes) is not "
                        "a whole number of 32-bit words")
    rounds = -(-(tile_bytes // 4) // head_dim)
    if rounds != k.v_rounds:
        raise ctx.error(k.where("v_rounds"), f"v_rounds = {k.v_rounds}, but the shared-V tile "
                        f"({tile_bytes // 4} words) stages in {rounds} rounds of {head_dim} "
                        f"threads at head_dim {head_dim}")


def check_shared_budget(k: Kernel, ctx: _Ctx) -> None:
    """At least the smallest legal launch (one group, the smallest head_dim) must fit
    the shared memory a block may use; a query_tile kernel, whose shared memory does
    not depend on the groups, at every head_dim it accepts (up to max_head_dim)."""
    if k.op is not Op.FLASH:
        return
    hd = k.max_head_dim if query_tiles(k) else min_head_dim(k)  # query_tile: its widest
    need = flash_shared_bytes(k, 1, hd)
    limit = TARGET.shared_per_block
    if need > limit:
        raise ctx.error(k.pos, f"needs {need} bytes of shared memory at kv_groups = 1, "
                        f"head_dim = {hd}; a block may use {limit}")


def check_expectations(k: Kernel, ctx: _Ctx) -> None:
    """Budgets name a ptxas resource; relations name a kernel with the same inputs."""
    for b in k.budgets:
        if b.resource not in RESOURCES:
            raise ctx.error(b.pos, f"unknown resource '{b.resource}'; expected one of "
                            + ", ".join(RESOURCES) + did_you_mean(b.resource, list(RESOURCES)))
        if b.value < 0:
            raise ctx.error(b.pos, f"expect {b.resource} {b.op} {b.value}: a resource count "
                            "is never negative")
    for r in k.relations:
        other = ctx.by_name.get(r.other)
        if other is None:
            raise ctx.error(r.pos, f"'{k.name}' is related to unknown kernel '{r.other}'"
                            + did_you_mean(r.other, sorted(ctx.by_name)))
        if (other.op, other.mode, other.position, other.kv, other.v_kv, other.in_dtype,
                other.out_dtype) != (k.op, k.mode, k.position, k.kv, k.v_kv, k.in_dtype,
                                     k.out_dtype):
            raise ctx.error(r.pos, f"'{k.name}' and '{r.other}' take different inputs "
                            "(op, mode, position, kv and v_kv must match to compare outputs)",
                            culprit=other)
        if k.pair.shadows and (other.ring_rows, other.sink_rows) != (k.ring_rows, k.sink_rows):
            raise ctx.error(r.pos, f"'{k.name}' and '{r.other}' lay out the fp16 shadows "
                            f"differently (ring_rows, sink_rows = {k.ring_rows}, "
                            f"{k.sink_rows} vs {other.ring_rows}, {other.sink_rows}): one "
                            "cache cannot feed both", culprit=other)
        if r.kind == "close_to" and not 0 < r.tolerance < 1:
            raise ctx.error(r.pos, f"tolerance {r.tolerance} must be in (0, 1)")


def _written_last(k: Kernel, *keys: str) -> str:
    """Of ``keys``, the one whose value the spec text sets last (where the error points)."""
    return max(keys, key=lambda n: (k.where(n).line, k.where(n).col))


def check_dflash_registers(k: Kernel, ctx: _Ctx) -> None:
    """A dflash lane holds its q and output dims and the K and V dims of the keys in
    flight in registers: they must fit a thread's."""
    if k.op not in (Op.DFLASH_ATTENTION, Op.DENSE_ATTENTION):  # the same warp's registers
        return
    held, limit = dflash_held_floats(k), TARGET.registers_per_thread
    if held > limit:
        key = _written_last(k, "max_head_dim", "keys_per_step")
        raise ctx.error(k.where(key), f"max_head_dim = {k.max_head_dim} and keys_per_step = "
                        f"{k.keys_per_step}: a lane holds {dflash_chunks(k)} dims of q, of "
                        f"the output and of the K and V of each key in flight ({held} "
                        f"floats); a {TARGET.arch} thread has {limit} registers")


def check_dense_tile(k: Kernel, ctx: _Ctx) -> None:
    """A dense_attention shared_tile block's K and V tiles (tile_keys rows of
    max_head_dim floats each) must fit the shared memory a block may use."""
    if k.op is not Op.DENSE_ATTENTION:
        return
    need, limit = dense_shared_bytes(k), TARGET.shared_per_block
    if need > limit:
        key = _written_last(k, "max_head_dim", "tile_keys")
        raise ctx.error(k.where(key), f"tile_keys = {k.tile_keys} and max_head_dim = "
                        f"{k.max_head_dim}: the K and V tiles need {need} bytes of shared "
                        f"memory; a block may use {limit}")


CHECKS: tuple[Callable[[Kernel, _Ctx], None], ...] = (
    check_keys_apply_to_op,
    check_kernel_name,
    check_module_name,
    check_doc_comment,
    check_limits,
    check_mode_position,
    check_attention_options,
    check_rows_per_block,
    check_schedule,
    check_ring_floor,
    check_dot_shape,
    check_register_k,
    check_shared_v,
    check_shared_budget,
    check_dflash_registers,
    check_dense_tile,
    check_expectations,
)


def check(kernels: list[Kernel], lines: Lines, named: Collection[str] | None = None,
          named_defs: Mapping[str, SourcePos] | None = None,
          beside: Beside | None = None) -> list[Kernel]:
    """Run every check on every kernel; returns the kernels unchanged. ``named``: the
    spec files checked (None: every kernel's), whose definitions are ``named_defs``;
    ``beside``: the rest of their spec set (kgen check FILE)."""
    ctx = _Ctx(kernels, lines, named, named_defs or {}, beside or Beside())
    for fn in CHECKS:
        ctx.contract = fn.__name__
        for k in kernels:
            ctx.current = k
            fn(k, ctx)
    return kernels
