"""The op ``concat_and_cache_mla``: MLA: the engine's ConcatAndCacheMla, latent kv_c and k_pe
rows into the paged cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kgen.ir.axes import Op
from kgen.ir.geometry import MLA_STORE_THREADS
from kgen.ir.params import INT_MAX
from kgen.ir.signature import elems, fixed
from kgen.ops.base import OpDef, PublicCall

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker


class MlaStore(OpDef):
    op = Op.MLA_STORE

    # --- spec: axes and checks
    mla = True
    in_dtype = True

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        # the engine's ConcatAndCacheMla; row strides in elements
        out = elems(k.in_dtype, "const ", "kv_c", "k_pe") + elems(k.in_dtype, "", "kv_cache")
        out += fixed("const long long *", "slot_mapping")
        out += fixed("int", "n_slots", "kv_c_stride", "k_pe_stride", "num_blocks", "block_size")
        return out

    def mla_threads(self, k: Kernel) -> int:
        return MLA_STORE_THREADS

    # --- render
    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        # a fixed block, all its shared memory static
        return self.mla_threads(k), 0

    # --- binding and launch
    entries = ("concat_and_cache_mla",)  # kgen.runtime's public calls
    public_calls = (PublicCall("concat_and_cache_mla", writes=("kv_cache",)),)

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        from kgen.runtime.checks import check_mla_shape

        check_mla_shape(k, c, hd, self.mla_width())

    def bind(self, k: Kernel, c: Checker, a: dict):
        """kv_c [T][MLA_LATENT] and k_pe [T][MLA_ROPE] (rows may be strided) into the latent
        pages at the slots of slot_mapping [S] int64 (S <= T; a negative slot skips)."""
        from kgen.ir.geometry import MLA_LATENT, MLA_ROPE, MLA_STORE_THREADS, mla_store_grid
        from kgen.runtime.checks import elem, latent_pages, slots_within

        T, kv_stride = self._bind_source_rows(c, "kv_c", a["kv_c"], MLA_LATENT, elem(k.in_dtype))
        T_pe, pe_stride = self._bind_source_rows(c, "k_pe", a["k_pe"], MLA_ROPE, elem(k.in_dtype))
        c.require(T_pe == T, "shape", lambda: f"k_pe has {T_pe} rows, kv_c {T}")
        nb, bs = latent_pages(k, c, "kv_cache", a["kv_cache"])
        sm = a["slot_mapping"]
        c.array("slot_mapping", sm, np.int64, 1)
        S = int(sm.shape[0])
        c.require(1 <= S <= T, "shape", lambda: f"slot_mapping has {S} slots for {T} tokens "
                  "(1 <= S <= T: the tail past S is padding)")
        if a.get("validate_pos", True):
            slots_within(c, sm, nb * bs)
        values = dict(kv_c=a["kv_c"], k_pe=a["k_pe"], kv_cache=a["kv_cache"], slot_mapping=sm,
                      n_slots=S, kv_c_stride=kv_stride, k_pe_stride=pe_stride, num_blocks=nb,
                      block_size=bs)
        return mla_store_grid(S), (MLA_STORE_THREADS, 1, 1), 0, values

    def _bind_source_rows(self, c: Checker, name: str, x, width: int,
                          dtype: np.dtype) -> tuple[int, int]:
        """A [rows][width] source of ``dtype`` whose rows may be strided (elements of a row
        adjacent); (rows, row stride in elements)."""
        c.require(hasattr(x, "shape") and hasattr(x, "dtype"), "array",
                  lambda: f"{name} must be an array, not {type(x).__name__}")
        c.require(x.dtype == dtype, "dtype", lambda: f"{name} must be {dtype.name}, not {x.dtype}")
        c.require(x.ndim == 2, "shape", lambda: f"{name} must have 2 dimensions, not shape "
                  f"{tuple(x.shape)}")
        rows = int(x.shape[0])
        c.shape(name, x, (rows, width))
        strides = getattr(x, "strides", None)
        if strides is None:  # a shape-only stand-in: C-contiguous
            return rows, width
        item = x.dtype.itemsize
        row = int(strides[0])
        c.require(int(strides[1]) == item and row % item == 0
                  and (rows <= 1 or row >= width * item), "contiguous",
                  lambda: f"{name} must have adjacent elements along a row and rows "
                  f"at least {width} elements apart (strides {tuple(strides)})")
        stride = row // item if rows > 1 else width
        c.require(stride <= INT_MAX, "int32 index", lambda: f"{name}'s row stride {stride} "
                  "overflows an int")
        return rows, stride

    # --- C++ view
    def cpp_roles(self) -> dict:
        return {"mla_store": self.role()}

    # --- contracts, reference and test cases
    mutated_array = "kv_cache"

    def contract_args(self, k, case, alloc) -> dict:
        from kgen.ir.geometry import MLA_LATENT, MLA_ROPE, MLA_ROW
        from kgen.testing.mla import elems, store_slots

        z, (ei, _) = alloc, elems(k)
        slots, nb = store_slots(case)
        return dict(kv_c=z((case.n, MLA_LATENT), ei), k_pe=z((case.n, MLA_ROPE), ei),
                    kv_cache=z((nb, case.block_size, MLA_ROW), ei), slot_mapping=slots)

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.testing.arguments import (
            Makers,
            Mutation,
            always,
            huge_pages,
            other_elem,
            zeros_like_shape,
        )

        m = Makers(self)
        return {
            **super().contract_mutations(),
            "mla_store_pe_rows_mismatch": Mutation("shape", always, m.replace_from_args(
                "k_pe", zeros_like_shape(lambda s: (s[0] + 1, s[1])))),
            "mla_store_kv_c_width": Mutation("shape", always, m.replace_from_args(
                "kv_c", zeros_like_shape(lambda s: (s[0], s[1] - 1)))),
            "mla_store_kv_c_column_strided": Mutation("contiguous", always, m.replace_from_args(
                "kv_c", lambda x, a: np.zeros((x.shape[0], 2 * x.shape[1]), x.dtype)[:, ::2])),
            "mla_store_k_pe_dtype": Mutation("dtype", always, m.replace_from_args(
                "k_pe", lambda x, a: x.astype(np.float64))),
            # one element type for the rows and the cache (in_dtype)
            "mla_store_cache_elem": Mutation("dtype", always, m.replace_from_args(
                "kv_cache", other_elem)),
            "mla_store_slots_over_tokens": Mutation("shape", always, m.replace_from_args(
                "slot_mapping", lambda x, a: np.arange(x.size + 1, dtype=np.int64))),
            "mla_store_slots_int32": Mutation("dtype", always, m.replace_from_args(
                "slot_mapping", lambda x, a: x.astype(np.int32))),
            "mla_store_cache_width": Mutation("shape", always, m.replace_from_args(
                "kv_cache", zeros_like_shape(lambda s: (s[0], s[1], s[2] - 64)))),
            "mla_store_positions_overflow": Mutation("int32 position", always,
                                                     m.replace_from_args("kv_cache",
                                                                         huge_pages)),
            "mla_store_slot_past_pages": Mutation("slot_mapping", always, m.replace_from_args(
                "slot_mapping", lambda x, a: x + 10**6)),
            "mla_store_slot_collision": Mutation("slot_mapping", always, m.replace_from_args(
                "slot_mapping", lambda x, a: np.zeros_like(x), n=3)),
        }

    def case_candidates(self, k) -> list:
        from kgen.testing.mla import STORE

        return STORE

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        return [Case("mla_smallest", n=2, block_size=2)]  # the smallest launch

    def gpu_check(self, k, fn, case, find) -> None:
        from kgen.testing import mla

        return mla.check_store(k, fn, case)


OP = MlaStore()
