"""Stage ``check``: semantic contracts on resolved kernels, in a fixed order.

Each ``check_*`` guards one contract the generated CUDA relies on and raises a
SpecError pointing at the assignment that breaks it; the message ends with the
contract's name, e.g. ``[check_register_k]``. ``CHECKS`` is the order. An op's own
part of a contract is its object's hook of the contract's name (``kgen.ops``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from kgen.compiler.spec.ast import SpecFile
from kgen.compiler.spec.contract import Beside, Ctx, Lines, ModuleClaim, kv_said, shadow_key
from kgen.compiler.spec.names import kernel_name_problem, module_name_problem
from kgen.errors import SourcePos, SpecError, did_you_mean
from kgen.ir.axes import KEYS, RESOURCES, Position
from kgen.ir.kernel import Kernel
from kgen.ir.target import TARGET
from kgen.ops import get


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


def check_keys_apply_to_op(k: Kernel, ctx: Ctx) -> None:
    """A key set on a kernel must mean something for its op."""
    takes = get(k.op).spec_keys
    for key in sorted(k.explicit_keys):
        spec = KEYS[key]
        if not spec.every_op and key not in takes:
            ops = ", ".join(sorted(o.value for o in spec.ops))
            raise ctx.error(k.where(key), f"'{key}' does not apply to op={k.op.value} "
                            f"(only to op={ops})")


def check_kernel_name(k: Kernel, ctx: Ctx) -> None:
    """The name is a C symbol, a PTX entry, a Python function and part of test names."""
    why = kernel_name_problem(k.name)
    if why is not None:
        raise ctx.error(k.pos, f"kernel name '{k.name}' {why}")


def check_module_name(k: Kernel, ctx: Ctx) -> None:
    """The module names generated files, a Python module and a C identifier: an ASCII
    identifier, unique ignoring case, not a kernel's name; and its kernels are defined
    in one spec file, so that building a file writes whole modules."""
    why = module_name_problem(k.module)
    if why is not None:
        raise ctx.error(k.where("module"), f"module {k.module!r} {why}")
    if k.module in ctx.by_name or k.module in ctx.beside.kernels:
        raise ctx.error(k.where("module"), f"module '{k.module}' has the name of a kernel "
                        f"(both are names of the kgen_kernels package)")
    named = ctx.beside.modules.get(k.name.lower())
    if named is not None and named.module == k.name:
        raise ctx.error(k.pos, f"kernel name '{k.name}' is the name of module '{k.name}' "
                        f"({named.pos}) (both are names of the kgen_kernels package)")
    first = ctx.modules.setdefault(k.module.lower(),
                                   ModuleClaim(k.module, k.where("module"), k.spec_path))
    if first.module != k.module:
        raise ctx.error(k.where("module"), f"module '{k.module}' differs from module "
                        f"'{first.module}' ({first.pos}) only in case (the C header and "
                        "case-insensitive file systems would mix them up)")
    if first.path != k.spec_path:
        raise ctx.error(k.where("module"), f"module '{k.module}' is a module of "
                        f"{first.path} (set at {first.pos}): a module's kernels are defined "
                        "in one spec file, so that building a file writes whole modules")


def check_doc_comment(k: Kernel, ctx: Ctx) -> None:
    """The doc lands inside a ``/* ... */`` comment, a Python comment and a docstring:
    one line of printable text (backslashes are escaped where they land)."""
    if "*/" in k.doc:
        raise ctx.error(k.where("doc"), "doc must not contain '*/' (it is emitted inside "
                        "a C comment)")
    bad = next((c for c in k.doc if not c.isprintable()), None)
    if bad is not None:
        raise ctx.error(k.where("doc"), f"doc must be one line of printable text, not "
                        f"{bad!r} (it is emitted in C and Python comments and a docstring)")


def check_limits(k: Kernel, ctx: Ctx) -> None:
    """Compile-time bounds with a legal launch, and not beyond what the target can use:
    append staging holds a row of at least one format block and at most a block's
    threads; the fp16 shadows' rows stay addressable (``TARGET.max_shadow_rows``)."""
    op = get(k.op)
    op.check_limits(k, ctx)
    if op.cache:
        for key in ("sink_rows", "ring_rows"):
            rows = getattr(k, key)
            if rows > TARGET.max_shadow_rows:
                raise ctx.error(k.where(key), f"{key} = {rows} exceeds "
                                f"{TARGET.max_shadow_rows} (a head's fp16 shadow rows are "
                                "addressed with int offsets)")


def check_mode_position(k: Kernel, ctx: Ctx) -> None:
    """Prefill reads pos0 from the host (or a varlen batch from a paged cache's
    index tensors); combine has no per-slot or paged form; a paged cache keeps no
    per-sequence fp16 shadows."""
    get(k.op).check_mode_position(k, ctx)
    if k.position is Position.PAGED and k.pair.shadows:
        raise ctx.error(k.where(shadow_key(k)), f"a paged cache keeps no per-sequence fp16 "
                        f"shadows: {kv_said(k)} needs them")


def check_attention_options(k: Kernel, ctx: Ctx) -> None:
    """A full (non-causal) mask is a prefill form (a decode query is the last
    position); a split decode leaves learned sinks to its combine, which sees the
    whole denominator."""
    get(k.op).check_attention_options(k, ctx)


def check_rows_per_block(k: Kernel, ctx: Ctx) -> None:
    """Several query rows per block share each staged K/V tile: a causal prefill over
    a contiguous cache whose rows all read the same values (no fp16 shadows: which
    shadow a key comes from depends on the row) with the tile-granular window, and
    one fold thread per (row, head) inside the first warp."""
    get(k.op).check_rows_per_block(k, ctx)


def check_schedule(k: Kernel, ctx: Ctx) -> None:
    """warp_stream runs over one contiguous sequence (a split decode at a host or
    device position, or a prefill row per block), its units reading K straight into
    registers and V from global memory; keys_per_step bounds the keys (and
    registers) a unit has in flight. query_tile is a contiguous prefill over a cache
    whose keys read the same for every row, with f32 tiles of a shape that fits a
    block (Flash._check_query_tile); its shape keys mean nothing to the other schedules."""
    get(k.op).check_schedule(k, ctx)


def check_ring_floor(k: Kernel, ctx: Ctx) -> None:
    """The batch live floor exists only for fp16 window shadows read by a batched prefill."""
    get(k.op).check_ring_floor(k, ctx)


def check_dot_shape(k: Kernel, ctx: Ctx) -> None:
    """Dot lanes reduce by shuffles within a warp; a tile must fit one block."""
    get(k.op).check_dot_shape(k, ctx)


def check_register_k(k: Kernel, ctx: Ctx) -> None:
    """Register K: the chunk bound must cover the smallest legal head_dim, and a
    format's lane dequant may fix the lanes and the chunk multiple (e.g. 16 lanes
    onto a 32-element block, two chunks a block)."""
    get(k.op).check_register_k(k, ctx)


def check_shared_v(k: Kernel, ctx: Ctx) -> None:
    """The shared-V tile stages raw rows at head_dim = tile_keys * dot_lanes as
    whole 32-bit words, in exactly v_rounds blockDim-strided rounds."""
    get(k.op).check_shared_v(k, ctx)


def check_shared_budget(k: Kernel, ctx: Ctx) -> None:
    """At least the smallest legal launch (one group, the smallest head_dim) must fit
    the shared memory a block may use; a query_tile kernel, whose shared memory does
    not depend on the groups, at every head_dim it accepts (up to max_head_dim)."""
    get(k.op).check_shared_budget(k, ctx)


def check_expectations(k: Kernel, ctx: Ctx) -> None:
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


def check_dflash_registers(k: Kernel, ctx: Ctx) -> None:
    """A dflash lane holds its q and output dims and the K and V dims of the keys in
    flight in registers: they must fit a thread's."""
    get(k.op).check_dflash_registers(k, ctx)


def check_dense_tile(k: Kernel, ctx: Ctx) -> None:
    """A dense_attention shared_tile block's K and V tiles (tile_keys rows of
    max_head_dim floats each) must fit the shared memory a block may use."""
    get(k.op).check_dense_tile(k, ctx)


CHECKS: tuple[Callable[[Kernel, Ctx], None], ...] = (
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
    ctx = Ctx(kernels, lines, named, named_defs or {}, beside or Beside())
    for fn in CHECKS:
        ctx.contract, ctx.check = fn.__name__, fn
        for k in kernels:
            ctx.current = k
            fn(k, ctx)
    return kernels
