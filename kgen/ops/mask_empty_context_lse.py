"""The op ``mask_empty_context_lse``: a helper of chunked prefill. Before the context
attention's partial result is merged with the new tokens' one (merge_attn_states), a
request whose context is empty must contribute nothing: its tokens' context LSE is set
to -inf (merge_attn_states then takes the new tokens' result verbatim there).

lse ``[n_head][n_tokens]`` f32 (merge_attn_states' LSE layout), written in place;
cu_seqlens_q ``[num_reqs + 1]`` int32 (request r owns tokens [cu[r], cu[r + 1]): cu[0]
= 0, non-decreasing, cu[num_reqs] = n_tokens); context_lens ``[num_reqs]`` int32 (>= 0).
Where context_lens[r] == 0, lse[h, t] = -inf for every head h and token t of request r;
every other element is left as it was, bit for bit.

The kernel (templates/kernels/mask_empty_context_lse.cu.j2): a 1-D grid of
MASK_THREADS-thread blocks, a thread per token; it finds its token's request by a
binary search in cu_seqlens_q and, where that request's context is empty, writes -inf
down its column (n_head stores, each coalesced across the warp's adjacent tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kgen.ir.axes import Op
from kgen.ir.params import INT_MAX
from kgen.ir.signature import fixed
from kgen.ops.base import OpDef, PublicCall

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker

MASK_THREADS = 256  # threads (tokens) of a block


def mask_grid(n_tokens):
    """The grid over ``n_tokens`` tokens: a thread each (also evaluated on the C++ view's
    symbolic token count: floor division and negation only)."""
    return (-(-n_tokens // MASK_THREADS), 1, 1)


class MaskEmptyContextLse(OpDef):
    op = Op.MASK_EMPTY_CONTEXT_LSE

    # --- spec: axes and checks (no keys of its own)

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        return (fixed("float *", "lse") + fixed("const int *", "cu_seqlens_q", "context_lens")
                + fixed("int", "n_tokens", "n_head", "num_reqs"))

    def validates_pos(self, k: Kernel) -> bool:
        return True  # cu_seqlens_q and context_lens are device index arrays

    # --- render
    takes_head_dim = False

    def block_shape(self, k, hd: int | None, groups: int | None) -> tuple[int, int]:
        return MASK_THREADS, 0  # a fixed block, no shared memory

    # --- binding and launch
    entries = ("mask_empty_context_lse",)  # kgen.runtime's public calls
    public_calls = (PublicCall("mask_empty_context_lse", writes=("lse",)),)

    def bind(self, k: Kernel, c: Checker, a: dict):
        """lse [n_head][n_tokens] f32, cu_seqlens_q [num_reqs + 1] and context_lens
        [num_reqs] int32, every array C-contiguous; with validate_pos, cu_seqlens_q read
        back rises from 0 to n_tokens and context_lens are >= 0. A thread per token."""
        from kgen.runtime.checks import host_ints, index

        lse = a["lse"]
        c.array("lse", lse, np.float32, 2)
        H, T = (int(n) for n in lse.shape)
        c.require(H >= 1 and T >= 1, "shape",
                  lambda: f"lse has shape {(H, T)}: nothing to mask")
        cu = a["cu_seqlens_q"]
        c.array("cu_seqlens_q", cu, np.int32, 1)
        reqs = int(cu.shape[0]) - 1
        c.require(reqs >= 1, "shape", "cu_seqlens_q needs num_reqs + 1 entries")
        index(c, a, "context_lens", (reqs,))
        c.require(T <= INT_MAX - MASK_THREADS, "int32 index",
                  lambda: f"{T} tokens overflow the kernel's int token index")
        if a.get("validate_pos", True):
            cu_h = host_ints(cu).astype(np.int64)
            c.require(int(cu_h[0]) == 0 and int(cu_h[-1]) == T and
                      bool((np.diff(cu_h) >= 0).all()), "cu_seqlens_q",
                      lambda: f"cu_seqlens_q must rise from 0 to the {T} tokens of lse")
            lens = host_ints(a["context_lens"]).astype(np.int64)
            c.require(bool((lens >= 0).all()), "context_lens",
                      lambda: f"context_lens[{int(np.argmin(lens))}] = {int(lens.min())} is "
                      "negative")
        values = dict(lse=lse, cu_seqlens_q=cu, context_lens=a["context_lens"], n_tokens=T,
                      n_head=H, num_reqs=reqs)
        return mask_grid(T), (MASK_THREADS, 1, 1), 0, values

    # --- C++ view
    def cpp_view(self, k, hd, groups, rows) -> dict:
        # the block and the grid over ``rows`` tokens, as kgen_launch.cpp's binder reads them
        return super().cpp_view(k, hd, groups, rows) | {
            "block_threads": MASK_THREADS, "shared_bytes": 0,
            "prefill_grid_x": mask_grid(rows)[0]}

    # --- contracts, reference and test cases
    mutated_array = "lse"

    @staticmethod
    def layout(case) -> tuple[np.ndarray, np.ndarray]:
        """(cu_seqlens_q, context_lens) int32 of a case: its ``requests`` are (tokens,
        context length) pairs."""
        tokens = [t for t, _ in case.requests]
        cu = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int32)
        return cu, np.array([n for _, n in case.requests], np.int32)

    @staticmethod
    def reference(lse: np.ndarray, cu_seqlens_q: np.ndarray,
                  context_lens: np.ndarray) -> np.ndarray:
        """The definition in float64: ``lse`` with -inf at every head of every token of a
        request whose context_lens entry is 0."""
        out = np.array(lse, dtype=np.float64)
        for r, n in enumerate(np.asarray(context_lens).tolist()):
            if n == 0:
                out[:, int(cu_seqlens_q[r]):int(cu_seqlens_q[r + 1])] = -np.inf
        return out

    def contract_args(self, k, case, alloc) -> dict:
        cu, lens = self.layout(case)
        return dict(lse=alloc((case.n_head, int(cu[-1])), np.float32), cu_seqlens_q=cu,
                    context_lens=lens)

    def contract_mutations(self) -> dict:
        from kgen.testing.arguments import Makers, Mutation, ShapeOnly, always, zeros_like_shape

        m = Makers(self)
        at = dict(requests=((2, 0), (3, 5)), n_head=3)  # two requests, one masked

        def lse_tokens(by):
            return m.replace_from_args("lse", zeros_like_shape(lambda s: (s[0], s[1] + by)),
                                       **at)
        return {
            **super().contract_mutations(),
            "mask_lse_flat": Mutation("shape", always, m.replace_from_args(
                "lse", lambda x, a: np.zeros(x.size, x.dtype), **at)),
            "mask_no_tokens": Mutation("shape", always, m.at(requests=((0, 0),))),
            "mask_no_requests": Mutation("shape", always, m.replace_from_args(
                "cu_seqlens_q", lambda x, a: x[:1].copy(), **at)),
            "mask_cu_int64": Mutation("dtype", always, m.replace_from_args(
                "cu_seqlens_q", lambda x, a: x.astype(np.int64), **at)),
            "mask_context_lens_int64": Mutation("dtype", always, m.replace_from_args(
                "context_lens", lambda x, a: x.astype(np.int64), **at)),
            "mask_context_lens_size": Mutation("shape", always, m.replace_from_args(
                "context_lens", lambda x, a: np.zeros(x.size + 1, x.dtype), **at)),
            "mask_context_lens_2d": Mutation("shape", always, m.replace_from_args(
                "context_lens", lambda x, a: x.reshape(1, -1).copy(), **at)),
            "mask_int32_tokens": Mutation("int32 index", always, m.replace_from_args(
                "lse", lambda x, a: ShapeOnly((1, INT_MAX - MASK_THREADS + 1), np.float32),
                **at)),
            # what validate_pos reads back (the C++ API reads no device memory)
            "mask_cu_past_tokens": Mutation("cu_seqlens_q", always, lse_tokens(-1)),
            "mask_cu_short_of_tokens": Mutation("cu_seqlens_q", always, lse_tokens(1)),
            "mask_cu_not_from_zero": Mutation("cu_seqlens_q", always, m.replace_from_args(
                "cu_seqlens_q", lambda x, a: x + 1, **at)),
            "mask_cu_falling": Mutation("cu_seqlens_q", always, m.replace_from_args(
                "cu_seqlens_q", lambda x, a: np.array([0, 4, 2, 5], x.dtype),
                requests=((2, 0), (1, 5), (2, 0)), n_head=3)),
            "mask_context_lens_negative": Mutation("context_lens", always, m.replace_from_args(
                "context_lens", lambda x, a: x - 1, **at)),
        }

    def case_candidates(self, k) -> list:
        from kgen.testing.case import Case

        # requests are (tokens, context length): masked ones (context 0) first, last, in
        # runs, between unmasked ones and across blocks; requests of no tokens (empty ones
        # masked or not, trailing ones: the search must land on the request holding the
        # token); a partial last block; one head and many.
        return [
            Case("r3_h8_mixed", requests=((5, 0), (3, 7), (4, 0)), n_head=8),
            Case("r5_h3_empty_requests", requests=((0, 0), (6, 0), (0, 5), (7, 3), (0, 0)),
                 n_head=3),
            Case("r5_h5_trailing_empty", requests=((3, 2), (2, 0), (0, 0), (0, 4), (0, 0)),
                 n_head=5),
            Case("r1_h32_t300_unmasked", requests=((300, 5),), n_head=32),
            Case("r1_h2_t700_masked", requests=((700, 0),), n_head=2),
            Case("r2_h16_t1000", requests=((513, 0), (487, 100)), n_head=16),
            Case("r64_h32_decode_like", requests=tuple((1, 0 if i % 3 == 0 else i)
                                                       for i in range(64)), n_head=32),
            Case("r9_h1_runs", requests=((40, 0), (33, 0), (1, 9), (250, 0), (17, 1),
                                         (0, 0), (600, 0), (2, 2), (31, 0)), n_head=1),
        ]

    def case_required(self, k) -> list:
        from kgen.testing.case import Case

        # a masked request beside an unmasked one (first: the contract tests' case, every
        # array wider than one element), then the smallest launch: one token of one head
        return [Case("r2_h2_t3_one_masked", requests=((2, 0), (1, 4)), n_head=2),
                Case("r1_h1_t1_smallest", requests=((1, 0),), n_head=1)]

    def gpu_check(self, k, fn, case, find) -> None:
        """lse random f32 with the values a mask must keep bit for bit (+-inf, +-0, a
        subnormal, NaNs with payloads); every element against the float64 reference:
        -inf where it says so, else the input's bits."""
        from kgen.testing.case import rng
        from kgen.testing.device import dev

        g, seed = rng()
        cu, lens = self.layout(case)
        H, T = case.n_head, int(cu[-1])
        lse = g.normal(2.0, 3.0, (H, T)).astype(np.float32)
        kept = np.array([0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001,
                         0x7FC00123, 0xFFC00456, 0x7F7FFFFF], np.uint32).view(np.float32)
        flat = lse.reshape(-1)
        at = g.choice(flat.size, min(flat.size, 4 * kept.size), replace=False)
        flat[at] = np.resize(kept, at.size)
        want = self.reference(lse, cu, lens)
        want32 = np.where(np.isneginf(want), np.float32(-np.inf), lse).astype(np.float32)
        d = dev(lse)
        fn(d, dev(cu), dev(lens))
        got = d.get()
        bad = np.flatnonzero(got.view(np.uint32) != want32.view(np.uint32))
        assert bad.size == 0, (
            f"{k.name}: {bad.size} of {got.size} elements differ from the reference "
            f"(first at [head, token] = {np.unravel_index(int(bad[0]), got.shape)}: "
            f"{got.reshape(-1)[bad[0]]!r}, want {want32.reshape(-1)[bad[0]]!r}), seed={seed}")


OP = MaskEmptyContextLse()
