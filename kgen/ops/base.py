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

from kgen.ir.axes import Op


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

    # --- C++ view (kgen.compiler.cpp_api)

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

    def gpu_check(self, k, fn, case) -> None:
        """Launch ``fn`` (the generated launcher of ``k``) on ``case`` and compare it
        with the float64 NumPy reference (kgen.numpy_ref, through kgen.testing)."""
        raise NotImplementedError(f"{self.op.value} has no GPU check")

    def gpu_relation(self, kind: str, tolerance: float, ka, fa, kb, fb, case) -> None:
        """Two kernels of the op on the same inputs: bit-identical or within
        ``tolerance`` (the relation a spec declares); by default both over one filled KV
        cache (kgen.testing.gpu.cache_relation)."""
        from kgen.testing import gpu

        return gpu.cache_relation(kind, tolerance, ka, fa, kb, fb, case)

    def __repr__(self) -> str:
        return f"<op {self.op.value}>"
