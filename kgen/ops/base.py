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

from kgen.ir.axes import Op, Position
from kgen.ir.geometry import MLA_ROW

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.pyapi import PyArg
    from kgen.ir.signature import Param


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

    def combine_staged(self, k: Kernel) -> bool:
        """Whether ``k`` merges split partials in stages (a block per COMBINE_DIMS dims)."""
        return False

    def mla_width(self) -> int:
        """The one row width the op's MLA kernels serve (their "head_dim")."""
        return MLA_ROW

    def mla_threads(self, k: Kernel) -> int:
        """Threads of an MLA kernel's block, fixed by its op (no MLA block: KeyError)."""
        raise KeyError(self.op)

    # --- render (kgen.compiler.render, kgen.compiler.coverage, kgen.compiler.view)

    # --- binding and launch (kgen.runtime)

    # --- C++ view (kgen.compiler.cpp_api)

    # --- contracts, reference and test cases (kgen.testing)

    def __repr__(self) -> str:
        return f"<op {self.op.value}>"
