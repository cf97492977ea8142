"""The op ``merge_attn_states``: the engine's MergeAttnStates: two partial results over
disjoint keys, merged by their LSEs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kgen.ir.axes import Lse, Op
from kgen.ir.params import INT_MAX
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef, PublicCall

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker


class MergeAttnStates(OpDef):
    op = Op.MERGE_ATTN_STATES

    # --- spec: axes and checks
    in_dtype = True
    out_dtype = True
    own_keys = frozenset({"lse"})

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:  # the engine's argument order and names
        out = elems(k.out_dtype, "", "output")
        out += fixed("float *", *(["output_lse"] if k.lse is Lse.WRITE else []))
        out += elems(k.in_dtype, "const ", "prefix_output")
        out += fixed("const float *", "prefix_lse")
        out += elems(k.in_dtype, "const ", "suffix_output")
        out += fixed("const float *", "suffix_lse")
        out += fixed("int", "n_tokens", "n_head", "head_dim", "prefill_tokens_with_context")
        return out

    # --- render
    listed = ("lse",)  # kgen list
    def render_flags(self, k) -> frozenset[str]:
        return frozenset({"merge"})

    def merge_io(self, k) -> tuple[tuple, ...]:
        return ((k.in_dtype.fmt, k.out_dtype.fmt),)

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block of warps, a warp per row
        from kgen.ir.geometry import merge_threads

        return merge_threads(), 0

    # --- binding and launch
    MERGE_LSES: ClassVar[tuple[str, ...]] = ("prefix_lse", "suffix_lse")  # the LSEs merged

    entries = ("merge_attn_states",)  # kgen.runtime's public calls
    public_calls = (PublicCall("merge_attn_states", writes=("output", "output_lse")),)

    def bind(self, k: Kernel, c: Checker, a: dict):
        """The engine's MergeAttnStates: output, prefix_output and suffix_output are
        [n_tokens][n_head][head_dim] (out_dtype, in_dtype); prefix_lse, suffix_lse (and
        output_lse, lse = write) [n_head][n_tokens] f32, every array C-contiguous. A warp
        merges one (token, head) row."""
        from kgen.ir.geometry import MERGE_ROWS, merge_grid, merge_threads
        from kgen.runtime.checks import elem, param

        out = a["output"]
        c.array("output", out, elem(k.out_dtype), 3)
        T, H, D = (int(x) for x in out.shape)
        c.require(T >= 1 and H >= 1 and D >= 1, "shape",
                  lambda: f"output has shape {(T, H, D)}: nothing to merge")
        for name in ("prefix_output", "suffix_output"):
            c.array(name, a[name], elem(k.in_dtype), 3)
            c.shape(name, a[name], (T, H, D))
        lses = (*self.MERGE_LSES, "output_lse") if k.lse is Lse.WRITE else self.MERGE_LSES
        for name in lses:
            x = a[name]
            c.array(name, x, np.float32, 2)
            c.require(tuple(x.shape) == (H, T), "lse layout",
                      lambda x=x, name=name: f"{name} has shape {tuple(x.shape)}; the LSE "
                      f"layout is [n_head][n_tokens] = {(H, T)}"
                      + (" (this is [n_tokens][n_head]: pass its transpose, made contiguous)"
                         if tuple(x.shape) == (T, H) else ""))
        c.require(T * H <= INT_MAX - MERGE_ROWS, "int32 index",
                  lambda: f"{T} tokens x {H} heads overflow the kernel's int row index")
        values = {name: a[name] for name in ("output", *lses, "prefix_output", "suffix_output")}
        values.update(n_tokens=T, n_head=H, head_dim=D,
                      prefill_tokens_with_context=param(c, a, "prefill_tokens_with_context"))
        return merge_grid(T, H), (merge_threads(), 1, 1), 0, values

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        """A warp per row strides any head_dim."""
        c.require(hd >= 1, "shape", lambda: f"head_dim = {hd}: nothing to merge")

    # --- C++ view
    def cpp_roles(self) -> dict:
        return {"merge": self.role(lse=Lse.NONE.value), "merge_lse": self.role(lse=Lse.WRITE.value)}

    # --- contracts, reference and test cases
    mutated_array = "output"

    def contract_args(self, k, case, alloc) -> dict:
        from kgen.testing import merge

        return merge.host_args(k, case, alloc)

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.ir.axes import Lse
        from kgen.ir.params import INT_MAX
        from kgen.testing.arguments import (
            Makers,
            Mutation,
            ShapeOnly,
            always,
            other_elem,
            strided,
        )

        m = Makers(self)

        def merge_set(name, value_fn):
            """The merge's arguments (at a case with n_tokens != n_head, so a transposed
            LSE is told apart) with ``name`` replaced by value_fn(its array, case)."""
            return m.replace_from_case(name, value_fn, n=5, n_head=3)

        def transposed(a, c):
            return np.zeros(a.shape[::-1], a.dtype)

        def lse_written(k) -> bool:
            return k.lse is Lse.WRITE
        return {
            **super().contract_mutations(),
            "merge_prefix_lse_transposed": Mutation("lse layout", always, merge_set(
                "prefix_lse", transposed)),
            "merge_suffix_lse_transposed": Mutation("lse layout", always, merge_set(
                "suffix_lse", transposed)),
            "merge_output_lse_transposed": Mutation("lse layout", lse_written, merge_set(
                "output_lse", transposed)),
            "merge_lse_flat": Mutation("shape", always, merge_set(
                "prefix_lse", lambda a, c: np.zeros(a.size, a.dtype))),
            "merge_lse_tokens_mismatch": Mutation("lse layout", always, merge_set(
                "suffix_lse", lambda a, c: np.zeros((a.shape[0], a.shape[1] + 1), a.dtype))),
            "merge_suffix_elem": Mutation("dtype", always, merge_set(
                "suffix_output", lambda a, c: other_elem(a, c))),
            "merge_output_elem": Mutation("dtype", always, merge_set(
                "output", lambda a, c: other_elem(a, c))),
            "merge_lse_dtype": Mutation("dtype", always, merge_set(
                "suffix_lse", lambda a, c: a.astype(np.float64))),
            "merge_lse_non_contiguous": Mutation("contiguous", always, merge_set(
                "prefix_lse", lambda a, c: np.zeros((a.shape[0], 2 * a.shape[1]),
                                                    a.dtype)[:, ::2])),
            "merge_output_lse_dtype": Mutation("dtype", lse_written, merge_set(
                "output_lse", lambda a, c: a.astype(np.float16))),
            "merge_head_dim_mismatch": Mutation("shape", always, merge_set(
                "suffix_output", lambda a, c: np.zeros((*a.shape[:2], a.shape[2] + 1),
                                                       a.dtype))),
            "merge_tokens_mismatch": Mutation("shape", always, merge_set(
                "prefix_output", lambda a, c: np.zeros((a.shape[0] + 1, *a.shape[1:]),
                                                       a.dtype))),
            "merge_heads_mismatch": Mutation("shape", always, merge_set(
                "prefix_output", lambda a, c: np.zeros((a.shape[0], a.shape[1] + 1,
                                                        a.shape[2]), a.dtype))),
            "merge_suffix_non_contiguous": Mutation("contiguous", always, merge_set(
                "suffix_output", lambda a, c: strided(a, None, c))),
            "merge_suffix_not_an_array": Mutation("array", always, merge_set(
                "suffix_output", lambda a, c: a.tolist())),
            "merge_no_tokens": Mutation("shape", always, m.at(n=0)),
            "merge_int32_rows": Mutation("int32 index", always, lambda k, c: m.args(
                k, c.with_(n=2**27, n_head=16, head_dim=1), alloc=ShapeOnly)),
            "merge_prefill_tokens_over_int": Mutation("range", always, lambda k, c: {
                **m.args(k, c), "prefill_tokens_with_context": INT_MAX + 1}),
        }

    def mutated_integer(self, k) -> str | None:
        return "prefill_tokens_with_context"

    def case_candidates(self, k) -> list:
        from kgen.testing.shapes import MERGE

        return MERGE

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        hd = self.case_smallest_head_dim(k)  # one dim a row, the edges over a partial block
        return [Case(f"hd{hd}_smallest", n=3, n_head=5, head_dim=hd, lse_pattern="edges"),
                Case(f"hd{hd}_smallest_ctx1", n=3, n_head=1, head_dim=hd,
                     prefill_tokens_with_context=1)]

    def gpu_check(self, k, fn, case, find) -> None:
        from kgen.testing import merge

        return merge.check(k, fn, case)


OP = MergeAttnStates()
