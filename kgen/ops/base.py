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

from typing import TYPE_CHECKING, ClassVar

from kgen.ir.axes import Op

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.runtime.contracts import Checker


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

    # --- binding and launch (kgen.runtime)
    sets_combine_tile: ClassVar[bool] = False  # its kernel's tile_keys is the tile a cache's
    #                                            combine then plans with (kgen.runtime.roles)
    sinks_keyword: ClassVar[bool] = False      # learned sinks come as the ``sinks`` keyword
    #                                            of Options.kwargs (a combine: its arrays)
    entries: ClassVar[tuple[str, ...]] = ()   # the public calls that launch its kernels, by
    #                                            name in kgen.runtime (and kgen); () where only
    #                                            the cache objects or its launchers reach them

    def bind(self, k: Kernel, c: Checker, a: dict) -> tuple:
        """``a`` checked against ``k``'s contracts: (grid, block, shared bytes, values)."""
        raise NotImplementedError(f"no binder for {self.op.value}")

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        """Refuses (``c``) a head_dim / q heads per kv head ``k`` can't launch, by shape."""
        from kgen.runtime.checks import check_head_dim

        check_head_dim(k, c, hd, rows=False)  # a block is head_dim threads

    def rank(self, k: Kernel, options: int) -> tuple:
        """Order among its kernels serving a role (min first), ``options``: axes off default."""
        return (options, False)

    # --- C++ view (kgen.compiler.cpp_api)

    # --- contracts, reference and test cases (kgen.testing)

    def __repr__(self) -> str:
        return f"<op {self.op.value}>"
