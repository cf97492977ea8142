"""The op ``decode_combine``: merge split-decode partials into the output."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kgen.ir.axes import Op, Position, Sinks
from kgen.ir.params import INT_MAX
from kgen.ir.signature import fixed, position_params
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.compiler.spec.contract import Ctx
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param
    from kgen.runtime.contracts import Checker


class DecodeCombine(OpDef):
    op = Op.DECODE_COMBINE

    # --- spec: axes and checks
    planned = True
    own_keys = frozenset({"position", "tile_keys", "sinks", "combine"})

    def check_mode_position(self, k: Kernel, ctx: Ctx) -> None:
        """The combine has no per-slot or paged form."""
        if k.position in (Position.SLOTS, Position.PAGED):
            raise ctx.error(k.where("position"), f"combine has no {k.position.value} form: those "
                            "partials are merged by the host-position combine over every "
                            "request's heads (n_splits = the launch width)")

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        out = fixed("const float *", "m_in", "l_in", "acc_in") + fixed("float *", "out")
        if k.sinks is Sinks.LEARNED:
            out += fixed("const float *", "sinks")
        out += fixed("int", "head_dim")
        out += position_params(k, fixed("int", "n_splits"))
        if k.position is not Position.HOST:
            out += fixed("int", "kps", "splits_cap")
        return out

    # --- render
    listed = ("position:pos",)  # kgen list
    lists_occupancy = True

    def render_flags(self, k) -> frozenset[str]:
        return frozenset({"combine", *(("combine_sinks",) if k.learned_sinks else ())})

    def occupancy_block(self, k, hd: int, groups: int | None) -> tuple[int, int]:
        from kgen.ir.geometry import combine_threads

        return combine_threads(k, hd), 0

    # --- binding and launch
    entries = ("paged_attention",)  # kgen.runtime's public calls

    def check_launch_shape(self, k: Kernel, c: Checker, hd: int, groups: int = 1) -> None:
        """A serial combine block is head_dim threads, a staged one COMBINE_THREADS (a block
        per COMBINE_DIMS dims, any head_dim), with the registers they need."""
        from kgen.ir.geometry import combine_staged, combine_threads
        from kgen.runtime.checks import block_registers, check_head_dim

        if combine_staged(k):  # any head_dim: a block per COMBINE_DIMS dims (grid y, checked)
            c.require(hd >= 1, "shape", lambda: f"head_dim = {hd}: nothing to combine")
        else:
            check_head_dim(k, c, hd, rows=False)
        block_registers(k, c, combine_threads(k, hd), hd)

    def bind(self, k: Kernel, c: Checker, a: dict):
        """The (m, l, acc) partials of out's heads into out [heads][head_dim]: n_splits of
        them (host), or the live plan's of the device position (kps, splits_cap)."""
        from kgen.ir.geometry import combine_grid, combine_threads
        from kgen.runtime.checks import PARTIALS_IN, device_positions, learned_sinks, partials
        from kgen.runtime.plan import decode_plan

        out = a["out"]
        c.array("out", out, np.float32, 2)
        heads, hd = (int(x) for x in out.shape)
        self.check_launch_shape(k, c, hd)
        for name in ("m_in", "l_in", "acc_in"):
            c.array(name, a[name], np.float32)
        values = dict(m_in=a["m_in"], l_in=a["l_in"], acc_in=a["acc_in"], out=out, head_dim=hd)
        if k.sinks is Sinks.LEARNED:
            values["sinks"] = learned_sinks(c, a, heads)
        if k.position is Position.HOST:
            width = c.integer("n_splits", a["n_splits"], 1)
            values["n_splits"] = width
        else:
            values["kps"] = c.integer("kps", a["kps"], 1)
            values["splits_cap"] = width = c.integer("splits_cap", a["splits_cap"], 1)
            values["pos"] = a["pos"]
            host = device_positions(k, c, a, 1, INT_MAX, rows=1, wrap=True)
            if host is not None:  # the live plan: partials are strided by its n_splits
                width = decode_plan(int(host[0]) + 1, values["kps"], width, k.tile_keys).n_splits
        partials(c, a, PARTIALS_IN, heads, width, hd)
        return combine_grid(k, heads, hd), (combine_threads(k, hd), 1, 1), 0, values

    def rank(self, k: Kernel, options: int) -> tuple:
        """The staged form (its loads in flight at once; the serial form's bits) before
        the serial one."""
        from kgen.ir.geometry import combine_staged

        return (options, not combine_staged(k))

    # --- C++ view

    # --- contracts, reference and test cases
    mutated_array = "out"

    def contract_args(self, k, case, alloc) -> dict:
        import numpy as np

        from kgen.ir.axes import Position, Sinks

        z, f32, hd = alloc, np.float32, case.head_dim
        pos = np.array(case.positions or (case.seq_len - 1,), dtype=np.int32)
        S = case.cap
        a = dict(m_in=z(case.n_head * S, f32), l_in=z(case.n_head * S, f32),
                 acc_in=z(case.n_head * S * hd, f32), out=z((case.n_head, hd), f32))
        if k.sinks is Sinks.LEARNED:
            a["sinks"] = z((case.n_head,), f32)
        if k.position is Position.HOST:
            a["n_splits"] = S
        else:
            a.update(pos=pos, kps=case.kps, splits_cap=case.cap)
        return a

    def contract_mutations(self) -> dict:
        import numpy as np

        from kgen.ir.axes import Sinks
        from kgen.ir.geometry import combine_staged
        from kgen.testing.arguments import (
            Makers,
            Mutation,
            always,
            argument_mutations,
            layout_mutations,
        )

        m = Makers(self)
        return {
            **argument_mutations(self),
            "sinks_wrong_size": Mutation("shape", lambda k: k.sinks is Sinks.LEARNED,
                                         lambda k, c: {**m.args(k, c),
                                                       "sinks": np.zeros(1, np.float32)}),
            "head_dim_over_block": Mutation("block size", lambda k: not combine_staged(k),
                                            m.big_head_dim),
            **layout_mutations(self),
            "partials_too_small": Mutation("partials size", always, lambda k, c: {
                **m.args(k, c), "acc_in": np.zeros(8, np.float32)}),
        }

    def mutated_integer(self, k) -> str | None:
        from kgen.ir.axes import Position

        return "n_splits" if k.position is Position.HOST else "kps"

    def case_candidates(self, k) -> list:
        from kgen.testing.shapes import COMBINE

        return COMBINE

    def case_required(self, k) -> list:
        from kgen.ir.axes import Sinks
        from kgen.testing.case import Case

        hd, T = self.case_smallest_head_dim(k), k.tile_keys
        base = Case(f"hd{hd}_smallest", n_head=3, head_dim=hd, n_splits=2, seq_len=2 * T + 3,
                    kps=T, cap=4)
        return [base, *([base.with_(name=f"{base.name}_sinks", sinks=True)]
                        if k.sinks is Sinks.LEARNED else [])]

    def gpu_check(self, k, fn, case, find) -> None:
        from kgen.testing import gpu

        return gpu.check_combine(k, fn, case)

    def gpu_relation(self, kind: str, tolerance: float, ka, fa, kb, fb, case) -> None:
        from kgen.testing import gpu

        return gpu.combine_relation(kind, tolerance, ka, fa, kb, fb, case)


OP = DecodeCombine()
