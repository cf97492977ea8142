"""The op ``concat_and_cache_mla``: MLA: the engine's ConcatAndCacheMla, latent kv_c and k_pe
rows into the paged cache.
"""

from __future__ import annotations

from kgen.ir.axes import Op
from kgen.ops.base import OpDef


class MlaStore(OpDef):
    op = Op.MLA_STORE

    # --- spec: axes and checks
    mla = True
    in_dtype = True

    # --- signature and geometry

    # --- render

    # --- binding and launch

    # --- C++ view

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

    def gpu_check(self, k, fn, case) -> None:
        from kgen.testing import mla

        return mla.check_store(k, fn, case)


OP = MlaStore()
