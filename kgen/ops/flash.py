"""The op ``flash``: tiled online-softmax attention over the KV cache: prefill and split decode."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kgen.ir.axes import KeySplit, Mode, Op, Position, Schedule, Sinks, SoftCap, Window
from kgen.ir.pyapi import PyArg
from kgen.ir.signature import cache_arrays, fixed, position_params
from kgen.ops.base import OpDef

if TYPE_CHECKING:
    from kgen.ir.kernel import Kernel
    from kgen.ir.signature import Param


class Flash(OpDef):
    op = Op.FLASH

    # --- spec: axes and checks
    cache = True
    planned = True

    # --- signature and geometry
    def params(self, k: Kernel) -> list[Param]:
        fmt = k.pair  # the cache's formats: shadows and scales of the roles that keep them
        shadows = [s.name for s in fmt.shadow_buffers()]
        shadow_scalars = list(fmt.shadow_scalars())
        scales = list(fmt.scale_scalars())
        out = fixed("const float *", "q")
        out += cache_arrays(k, "const ")
        out += fixed("const __half *", *shadows)
        if k.mode is Mode.PREFILL:
            out += fixed("float *", *(("m_out", "l_out", "acc_out")
                                      if k.key_split is KeySplit.PARTIALS else ("out",)))
            if k.sinks is Sinks.LEARNED:
                out += fixed("const float *", "sinks")
        else:
            out += fixed("float *", "m_out", "l_out", "acc_out")
        if k.position is Position.PAGED:
            out += fixed("const int *", "block_table", "seq_lens")
            if k.mode is Mode.PREFILL:
                out += fixed("const int *", "query_start_loc")
            out += fixed("int", "kv_groups", "head_dim", "block_size", "max_blocks")
            out += fixed("int", "num_reqs") if k.mode is Mode.PREFILL else \
                fixed("int", "kps", "splits_cap")
            if k.key_split is KeySplit.PARTIALS:
                out += fixed("int", "n_splits")
        elif k.mode is Mode.PREFILL:
            out += fixed("int", "kv_groups", "head_dim", "max_seq")
            out += fixed("int", "pos0")
            if k.rows_per_block > 1 or k.schedule is Schedule.QUERY_TILE:
                out += fixed("int", "n_rows")
            if k.key_split is KeySplit.PARTIALS:
                out += fixed("int", "n_splits")
        else:
            out += fixed("int", "kv_groups", "head_dim", "max_seq")
            out += position_params(k, fixed("int", "seq_len", "n_splits", "split_len"))
            if k.position is not Position.HOST:
                out += fixed("int", "kps", "splits_cap")
        out += fixed("int", *shadow_scalars)
        out += fixed("float", *scales)
        if k.window is Window.EXACT:
            out += fixed("int", "attn_sink", "win_left", "win_right")
        else:
            out += fixed("int", "attn_sink", "attn_win")
        out += fixed("float", "scale")
        if k.softcap is SoftCap.TANH:
            out += fixed("float", "softcap")
        return out

    def host_bounds(self, k: Kernel) -> list[PyArg]:
        if k.mode is Mode.DECODE and k.position is Position.SLOTS:
            return [PyArg("launch_splits", "int | None", "None")]
        if k.mode is Mode.DECODE and k.position is Position.PAGED:
            return [PyArg("max_seq_len", "int | None", "None")]  # host bound: the grid
        if k.mode is Mode.PREFILL and k.position is Position.PAGED:
            return [PyArg("max_query_len", "int | None", "None")]  # host bound: the grid
        return []

    # --- render

    # --- binding and launch

    # --- C++ view

    # --- contracts, reference and test cases


OP = Flash()
