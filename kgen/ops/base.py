"""What every engine op answers: the base of the op objects in ``kgen.ops``.

An op object owns everything about one engine op: which spec keys it takes, its
kernels' parameter list and launch geometry, what its template needs, how a launch
binds its arguments, its C++ view, its contracts, float64 reference and test cases.
Code outside ``kgen/ops`` asks the op object (``kgen.ops.get(k.op)``) and never
switches on an op's name. A hook's default here is what most ops answer; an op
overrides only what is its own.

The sections below keep one order in every op module (each tier's hooks together):
spec, signature and geometry, render, binding and launch, C++ view, testing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, ClassVar

from kgen.ir.axes import IoDtype, Mode, Op, Position, Schedule
from kgen.ir.geometry import MLA_ROW
from kgen.ir.role import Role

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel
    from kgen.ir.pyapi import PyArg
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker, ContractError


@dataclass(frozen=True)
class PublicCall:
    """What one public call (``kgen.runtime.<name>``, one of an op's ``entries``) does
    with its arrays beyond what its signature says. The signature stays the call's own;
    kgen.torch builds the call's torch.library op from the two.

    ``writes``: the arrays it writes in place (a torch op's mutated arguments).
    ``optional``: arrays without a default that may be None.
    ``tensors``: arrays the call converts itself (not through its convention's
    ``arrays``), which a torch op passes as tensors.
    ``result``: the parameter a new array it returns is shaped and typed as (None: what
    it returns is no new array: a Launch, a written argument).
    ``leaves``: parameters a torch op leaves at their defaults (an ``out=`` that a new
    result replaces)."""

    name: str
    writes: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    tensors: tuple[str, ...] = ()
    result: str | None = None
    leaves: tuple[str, ...] = ()


class OpDef:
    """One engine op. Subclasses set ``op`` and override the hooks that differ."""

    op: ClassVar[Op]  # the spec's spelling (``op = ...`` in a kernel block)

    # --- spec: axes and checks (kgen.compiler.spec, kgen.ir.axes)
    # What kind of op it is; the tiers ask these in place of lists of op names.
    cache: ClassVar[bool] = False      # reads or writes the KV formats' cache (kv, v_kv axes)
    mla: ClassVar[bool] = False        # over the MLA latent cache: one row width, fixed
    #                                    at compile time
    planned: ClassVar[bool] = False    # a device, slots or paged position reads the plan
    #                                    (keys per split, splits cap)
    in_dtype: ClassVar[bool] = False   # its input tensors have an element type of their own
    out_dtype: ClassVar[bool] = False  # its output tensors have an element type of their own
    # The spec keys of its own (``kgen.ir.axes.KEYS``); those of its kind come with it.
    own_keys: ClassVar[frozenset[str]] = frozenset()

    @cached_property
    def spec_keys(self) -> frozenset[str]:
        """The keys its kernels may set beside every kernel's (module, doc, op): its own,
        a cache op's formats and fp16 shadow rows, its in_dtype and out_dtype."""
        kind = ((("kv", "v_kv", "ring_rows", "sink_rows") if self.cache else ())
                + (("in_dtype",) if self.in_dtype else ())
                + (("out_dtype",) if self.out_dtype else ()))
        return self.own_keys | frozenset(kind)

    # Its part of the semantic checks (kgen.compiler.spec.check): each hook raises
    # ``ctx.error(...)`` for what the contract of its name refuses for this op; check.py
    # runs them in CHECKS' order. The default refuses nothing.
    def check_limits(self, k: Kernel, ctx: Ctx) -> None:
        """Refuses compile-time bounds of its own that admit no launch or exceed the target."""

    def check_mode_position(self, k: Kernel, ctx: Ctx) -> None:
        """Refuses a position that its mode (or the op) has no form for."""

    def check_attention_options(self, k: Kernel, ctx: Ctx) -> None:
        """Refuses a mask or sinks that its mode cannot apply."""

    def check_rows_per_block(self, k: Kernel, ctx: Ctx) -> None:
        """Refuses query rows a block cannot share K/V tiles across."""

    def check_schedule(self, k: Kernel, ctx: Ctx) -> None:
        """Refuses a schedule (and its keys) that the kernel's other axes do not serve."""

    def check_ring_floor(self, k: Kernel, ctx: Ctx) -> None:
        """Refuses a window-ring live floor without the ring or the batch it is taken from."""

    def check_dot_shape(self, k: Kernel, ctx: Ctx) -> None:
        """Refuses dot lanes and tiles that do not reduce in a warp or fit a block."""

    def check_register_k(self, k: Kernel, ctx: Ctx) -> None:
        """Refuses register-K chunks that miss a legal head_dim or a format's lane layout."""

    def check_shared_v(self, k: Kernel, ctx: Ctx) -> None:
        """Refuses a shared-V tile that does not stage in whole words and v_rounds rounds."""

    def check_shared_budget(self, k: Kernel, ctx: Ctx) -> None:
        """Refuses a smallest launch whose shared memory exceeds a block's."""

    def check_dflash_registers(self, k: Kernel, ctx: Ctx) -> None:
        """Refuses a lane's q, output and in-flight K/V dims beyond a thread's registers."""

    def check_dense_tile(self, k: Kernel, ctx: Ctx) -> None:
        """Refuses staged K/V tiles beyond the shared memory a block may use."""

    # --- signature and geometry (kgen.ir.signature, kgen.ir.geometry, kgen.ir.pyapi)
    def params(self, k: Kernel) -> list[Param]:
        """The parameter list of ``k``'s kernel, in argument order (kgen.ir.signature)."""
        return []

    def host_bounds(self, k: Kernel) -> list[PyArg]:
        """Launcher scalars that are no kernel parameter: host bounds that size the grid."""
        return []

    def validates_pos(self, k: Kernel) -> bool:
        """Whether the launcher takes validate_pos: ``k`` reads indices from the device."""
        # positions, tables or lengths on the device (the MLA ops' index tensors too)
        return k.position is not Position.HOST or self.mla

    def mla_width(self) -> int:
        """The one row width the op's MLA kernels serve (their "head_dim")."""
        return MLA_ROW

    def mla_threads(self, k: Kernel) -> int:
        """Threads of an MLA kernel's block, fixed by its op (no MLA block: KeyError)."""
        raise KeyError(self.op)

    # --- render (kgen.compiler.render, kgen.compiler.coverage, kgen.compiler.view)
    # The axes ``kgen list`` shows after the op's name, those that tell its kernels apart:
    # "axis" as axis=value, "axis:label" as label=value, "=axis" as the value alone;
    # in_dtype and out_dtype follow where the op has them.
    listed: ClassVar[tuple[str, ...]] = ()

    def describe(self, k: Kernel) -> str:
        """The kernel's one-line axes in ``kgen list``: the op, then its listed axes."""
        shown = [*self.listed, *(("in_dtype",) if self.in_dtype else ()),
                 *(("out_dtype",) if self.out_dtype else ())]
        return " ".join([self.op.value, *(
            getattr(k, a[1:]).value if a.startswith("=") else
            f"{a.split(':')[-1]}={getattr(k, a.split(':')[0]).value}" for a in shown)])

    # ``k`` is the kernel, or its template view (kgen.compiler.view.KernelView) where a
    # hook reads a view's fact (render_flags, format_uses).
    takes_head_dim: ClassVar[bool] = True  # its launches take a head_dim (the coverage
    #                                        weighs the head_dims it serves)
    grouped_block: ClassVar[bool] = False  # its block grows with kv_groups (the coverage
    #                                        weighs the most each head_dim fits, max_groups)
    lists_occupancy: ClassVar[bool] = False  # `kgen list --json` reports its sm_37 occupancy

    def kernel_template(self, k) -> str:
        """The template of ``k``'s kernel: the op's own, templates/kernels/<op>.cu.j2."""
        return f"kernels/{self.op.value}.cu.j2"

    def template_schedule(self, k) -> Schedule | None:
        """How ``k``'s block walks its keys, where the op's kernels have several skeletons
        (KernelView.stream, .qtile); None: the op has one."""
        return None

    def template_mode(self, k) -> Mode | None:
        """Whether ``k`` is a prefill or a decode, where the op's kernels are either
        (KernelView.prefill, .per_request); None: the op has no mode."""
        return None

    def writes_mla_lse(self, k) -> bool:
        """Whether ``k`` writes an MLA LSE beside its output (KernelView.writes_mla_lse)."""
        return False

    def mla_causal(self, k) -> bool:
        """Whether ``k`` is a causal MLA prefill (KernelView.mla_causal)."""
        return False

    def render_flags(self, k) -> frozenset[str]:
        """The module flags ``k`` turns on (``needs`` in templates/module.cu.j2): the lib
        helpers its module includes (window, paged, combine, merge, mla, dflash),
        their options (exact_window, combine_sinks) and fp16 (cuda_fp16.h)."""
        return frozenset()

    def merge_io(self, k) -> tuple[tuple, ...]:
        """The (input, output) element formats of the merge row helpers ``k`` calls
        (templates/lib/merge.cuh.j2)."""
        return ()

    def template_parts(self, k) -> tuple[str, ...]:
        """The shared template parts a module of ``k`` includes beside its kernel template."""
        return ()

    def format_uses(self, k) -> dict[str, set[str]]:
        """Which of its formats' device helpers ``k`` calls, per format name (a format's lib
        file emits only the helpers in use): none."""
        return {}

    def sized_head_dim(self, k) -> int | None:
        """The widest head_dim ``k``'s own axes size it for; None where only the target's
        block limit bounds its head_dim."""
        return None

    def served_step(self, k) -> int | None:
        """The head_dim step at which the coverage weighs every head_dim ``k`` serves (its
        shared memory varies with head_dim and groups); None: only the smallest and widest
        (and the widest its axes size it for)."""
        return None

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        """(threads, dynamic shared bytes) of a block of ``k`` launched at head_dim ``hd``
        (None only for an op whose launches take none) and ``groups`` (a grouped block's):
        head_dim threads, all its shared memory static (an append or combine block)."""
        return hd, 0

    def occupancy_block(self, k, hd: int, groups: int | None) -> tuple[int, int]:
        """(threads, dynamic shared bytes) of the block whose occupancy `kgen list --json`
        reports at head_dim ``hd`` and ``groups`` (a grouped block's): head_dim threads, no
        dynamic shared memory."""
        return hd, 0

    def limit_facts(self, k) -> dict:
        """The op's own shape limits of ``k`` (`kgen list --json`): none."""
        return {}

    # --- binding and launch (kgen.runtime)
    def role(self, in_dtype: IoDtype = IoDtype.F32, out_dtype: IoDtype = IoDtype.F32,
             **needs: str) -> Role:
        """What a call of the op needs a kernel for: the option axes it asks (by value)
        and, where the op has them, its inputs' and outputs' element types."""
        if self.in_dtype:
            needs["in_dtype"] = in_dtype.value
        if self.out_dtype:
            needs["out_dtype"] = out_dtype.value
        return Role(self.op, needs=tuple(sorted(needs.items())))

    sets_combine_tile: ClassVar[bool] = False  # its kernel's tile_keys is the tile a cache's
    #                                            combine then plans with (kgen.runtime.roles)
    sinks_keyword: ClassVar[bool] = False      # learned sinks come as the ``sinks`` keyword
    #                                            of Options.kwargs (a combine: its arrays)
    entries: ClassVar[tuple[str, ...]] = ()   # the public calls that launch its kernels, by
    #                                            name in kgen.runtime (and kgen); () where only
    #                                            the cache objects or its launchers reach them
    # What its entries do with their arrays (PublicCall), for those whose facts it owns: a
    # call that launches several ops' kernels is described by one of them, once.
    public_calls: ClassVar[tuple[PublicCall, ...]] = ()

    def bind(self, k: Kernel, c: Checker, a: dict) -> tuple:
        """``a`` checked against ``k``'s contracts: (grid, block, shared bytes, values)."""
        raise NotImplementedError(f"no binder for {self.op.value}")

    def shape_error(self, k: Kernel, hd: int, groups: int = 1) -> ContractError | None:
        """The launch contract ``k`` breaks at head_dim ``hd`` with ``groups`` q heads per
        KV head (its check_launch_shape), or None."""
        from kgen.runtime.contracts import Checker, ContractError

        try:
            self.check_launch_shape(k, Checker(k.name), hd, groups)
        except ContractError as exc:
            return exc
        return None

    def shape_refusal(self, k: Kernel, hd: int, groups: int = 1) -> str | None:
        """Why ``k`` cannot launch at head_dim ``hd`` with ``groups`` (shape_error's
        message), or None."""
        exc = self.shape_error(k, hd, groups)
        return None if exc is None else str(exc)

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        """Refuses (``c``) a head_dim / q heads per kv head ``k`` can't launch, by shape."""
        from kgen.runtime.checks import check_head_dim

        check_head_dim(k, c, hd, rows=False)  # a block is head_dim threads

    def rank(self, k: Kernel, options: int) -> tuple:
        """Order among its kernels serving a role (min first), ``options``: axes off default."""
        return (options, False)

    # --- C++ view (kgen.compiler.cpp_api)
    def cpp_view(self, k, hd, groups, rows) -> dict:
        """What the C++ launcher's kernel table holds of ``k``'s op: its tiling, the paged
        key source, and its block threads, shared bytes and prefill grid x in the launch's
        head_dim, kv_groups and query rows (the symbolic ``hd``, ``groups``, ``rows``:
        kgen.compiler.cpp_api.Sym; None: the op has none)."""
        return {"query_tiles": False, "padded": False, "hoisted": False,
                "key_partials": False, "paged_keys": False, "stream_head_dim": 0,
                "tile_threads": 0, "out_cols": 0, "row_lanes": 0, "head_dim_step": 0,
                "block_threads": None,
                "shared_bytes": None, "prefill_grid_x": None}

    def cpp_roles(self) -> dict:
        """The roles of the op's op-level entry points (templates/c/kgen_ops.*.j2), as the
        Python entry points build them: {C++ name: kgen.ir.role.Role}; none."""
        return {}

    # --- contracts, reference and test cases (kgen.testing)
    # The array argument the generic mutations break (not an array, float64, strided).
    mutated_array: ClassVar[str]
    # A candidate its kernel refuses is retried at testgen.retry_head_dim before it
    # counts as refused.
    case_retries_refused: ClassVar[bool] = False

    def contract_args(self, k, case, alloc) -> dict:
        """A valid argument set of host arrays for ``bind`` (contents irrelevant, index
        arrays a valid layout); ``alloc(shape, dtype)`` makes each array."""
        raise NotImplementedError(f"{self.op.value} gives no contract arguments")

    def contract_mutations(self) -> dict:
        """Its contract mutations in order, name -> kgen.testing.arguments.Mutation: each
        breaks one contract of a valid launch (its ``applies`` asks the kernel's axes)."""
        from kgen.testing.arguments import argument_mutations, layout_mutations

        return {**argument_mutations(self), **layout_mutations(self)}

    def mutated_integer(self, k) -> str | None:
        """The user-visible integer argument the type mutation breaks, if it has one."""
        return None

    def call_args(self, call: str, k, case, alloc) -> dict | None:
        """A valid argument set of the public call ``call`` (one of its ``public_calls``)
        at ``case`` over the shapes of its kernel ``k``, by parameter name: host arrays
        from ``alloc`` (index arrays a valid layout), a PagedMetadata's own arguments in
        its place; None where ``k``'s cases give none. By default the kernel's contract
        arguments (those the call does not take are left out by whoever asks), for the
        calls that name their arrays as their kernels do."""
        return self.contract_args(k, case, alloc)

    def case_candidates(self, k) -> list:
        """The candidate shapes (kgen.testing.Case) its kernel's tests run, beside the
        required ones."""
        raise NotImplementedError(f"{self.op.value} has no test candidates")

    def case_required(self, k) -> list:
        """The shapes every kernel of the op is tested at, derived from its axes."""
        raise NotImplementedError(f"{self.op.value} has no required test shapes")

    def case_smallest_head_dim(self, k) -> int:
        """The smallest head_dim its kernel launches with."""
        return 1

    def case_registers_bound(self, k) -> bool:
        """Whether the registers ptxas gave its kernel may bound its head_dim (a block
        that grows with head_dim; testgen.register_bound)."""
        return False

    def gpu_check(self, k, fn, case, find) -> None:
        """Launch ``fn`` (the generated launcher of ``k``) on ``case`` and compare it
        with the float64 NumPy reference (kgen.numpy_ref, through kgen.testing).
        ``find`` is the harness's way to another generated kernel
        (kgen.runtime.select.find), for a check that launches a sibling too."""
        raise NotImplementedError(f"{self.op.value} has no GPU check")

    def gpu_relation(self, kind: str, tolerance: float, ka, fa, kb, fb, case) -> None:
        """Two kernels of the op on the same inputs: bit-identical or within
        ``tolerance`` (the relation a spec declares); by default both over one filled KV
        cache (kgen.testing.gpu.cache_relation)."""
        from kgen.testing import gpu

        return gpu.cache_relation(kind, tolerance, ka, fa, kb, fb, case)

    def __repr__(self) -> str:
        return f"<op {self.op.value}>"
