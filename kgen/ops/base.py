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

from typing import ClassVar

from kgen.ir.axes import Mode, Op, Schedule


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

    # --- signature and geometry (kgen.ir.signature, kgen.ir.geometry, kgen.ir.pyapi)

    # --- render (kgen.compiler.render, kgen.compiler.coverage, kgen.compiler.view)
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

    # --- C++ view (kgen.compiler.cpp_api)
    def cpp_view(self, k, hd, groups, rows) -> dict:
        """What the C++ launcher's kernel table holds of ``k``'s op: its tiling, the paged
        key source, and its block threads, shared bytes and prefill grid x in the launch's
        head_dim, kv_groups and query rows (the symbolic ``hd``, ``groups``, ``rows``:
        kgen.compiler.cpp_api.Sym; None: the op has none)."""
        return {"query_tiles": False, "padded": False, "hoisted": False,
                "key_partials": False, "paged_keys": False, "stream_head_dim": 0,
                "tile_threads": 0, "out_cols": 0, "row_lanes": 0, "head_dim_step": 0,
                "k_quad_align": 0, "v_quad_align": 0, "block_threads": None,
                "shared_bytes": None, "prefill_grid_x": None}

    def cpp_roles(self) -> dict:
        """The roles of the op's op-level entry points (templates/c/kgen_ops.*.j2), as the
        Python entry points build them: {C++ name: kgen.runtime.select.Role}; none."""
        return {}

    # --- contracts, reference and test cases (kgen.testing)

    def __repr__(self) -> str:
        return f"<op {self.op.value}>"
