"""Bind a kernel's arguments: contracts, geometry and the argument tuple.

Pure Python over anything array-like (``shape``, ``dtype``, ``flags``), so the
same checks run on CuPy arrays before a launch and on NumPy arrays in tests
without a GPU. Derived kernel arguments (kv_groups, head_dim, max_seq,
n_head_kv, total) come from the array shapes; the caller passes the rest.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from kgen import ops
from kgen.ir.axes import (
    MLA_OPS,
    KeySource,
    KStage,
    Lse,
    Mode,
    Op,
    Position,
    SeqStarts,
    Sinks,
    SoftCap,
    VStage,
    Window,
)
from kgen.ir.geometry import (
    DENSE_ROWS,
    DFLASH_ROWS,
    MERGE_ROWS,
    MLA_COMBINE_THREADS,
    MLA_LATENT,
    MLA_PREFILL_QK,
    MLA_PREFILL_ROWS,
    MLA_PREFILL_V,
    MLA_ROPE,
    MLA_ROW,
    MLA_STORE_THREADS,
    MLA_THREADS,
    block_threads,
    combine_grid,
    combine_staged,
    combine_threads,
    dense_grid,
    dense_threads,
    dflash_grid,
    dflash_threads,
    flash_shared_bytes,
    head_dim_step,
    key_partials,
    merge_grid,
    merge_threads,
    mla_combine_grid,
    mla_decode_grid,
    mla_gather_grid,
    mla_gather_threads,
    mla_prefill_grid,
    mla_store_grid,
    out_cols,
    padded,
    paged_prefill_grid,
    prefill_grid,
    quad_reads,
    query_tiles,
    row_lanes,
    stream_head_dim,
    stream_hoisted,
    tile_threads,
)
from kgen.ir.kernel import Kernel
from kgen.ir.params import INT_MAX, PARAMS
from kgen.ir.target import TARGET
from kgen.ops import params
from kgen.runtime.contracts import Checker, ContractError
from kgen.runtime.plan import decode_plan
from kgen.runtime.record import registers

QZ_BLOCK = 256  # threads per block of the 1-D qz_split launch
REGISTERS = "block registers"  # the contract a block too large for its registers breaks


class Launch(NamedTuple):
    """A bound launch. A named tuple, not a dataclass: a launch replaying a
    remembered binding makes one per call, and this is the cheapest to make."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple  # in the kernel's parameter order: arrays, then typed scalars
    names: tuple[str, ...]

    def arg(self, name: str):
        return self.args[self.names.index(name)]


def reads_device(k: Kernel, a: dict) -> bool:
    """Whether binding ``a`` reads device memory: the positions, block tables, seq
    lens and slot maps every non-host-position binder copies back and checks
    unless ``validate_pos`` is false. Such a binding holds for those contents
    only; it is never replayed."""
    return (k.position is not Position.HOST or k.op in MLA_OPS) and \
        bool(a.get("validate_pos", True))


def _order(k: Kernel, values: dict) -> tuple[tuple, tuple[str, ...]]:
    out, names = [], []
    for p in params(k):
        v = values[p.name]
        if not p.is_pointer:
            v = np.float32(v) if p.ctype == "float" else np.int32(v)
        out.append(v)
        names.append(p.name)
    return tuple(out), tuple(names)


def _grid(c: Checker, grid: tuple[int, int, int]) -> tuple[int, int, int]:
    c.require(1 <= grid[0] <= TARGET.grid_x_max, "grid", lambda: f"grid.x = {grid[0]} out of range")
    c.require(grid[1] <= TARGET.grid_yz_max and grid[2] <= TARGET.grid_yz_max, "grid",
              lambda: f"grid {grid} exceeds {TARGET.grid_yz_max} in y or z")
    return grid


def bind(k: Kernel, a: dict) -> Launch:
    """Check ``a`` (argument name -> value) against ``k``'s contracts; build the Launch."""
    binder = {Op.QZ_SPLIT: _qz_split, Op.KV_APPEND: _kv_append, Op.FLASH: _flash,
              Op.DECODE_COMBINE: _combine, Op.MERGE_ATTN_STATES: _merge,
              Op.MLA_STORE: _mla_store, Op.MLA_GATHER: _mla_gather, Op.MLA_DECODE: _mla_decode,
              Op.MLA_COMBINE: _mla_combine, Op.MLA_PREFILL: _mla_prefill,
              Op.DFLASH_ATTENTION: _dflash, Op.DENSE_ATTENTION: _dense}[k.op]
    if k.position is Position.PAGED:
        binder = _paged_append if k.op is Op.KV_APPEND else _paged_flash
    expected = {p.name for p in params(k)}
    c = Checker(k.name)
    grid, block, smem, values = binder(k, c, dict(a))
    missing = expected - set(values)
    assert not missing, f"binder for {k.name} left {missing} unset"
    args, names = _order(k, values)
    return Launch(k.name, _grid(c, grid), block, smem, args, names)


# ---- contracts shared by several ops ----------------------------------------

def _head_dim(k: Kernel, c: Checker, hd: int, rows: bool) -> None:
    """A block is head_dim threads; ``rows``: head_dim also lays out cache rows."""
    c.require(TARGET.fits_block(hd), "block size",
              lambda: f"head_dim = {hd}: a block is head_dim threads, at most {TARGET.max_threads}")
    if rows:
        fmt = k.pair  # both roles' rows
        c.require(fmt.accepts_head_dim(hd), "row format",
                  lambda: f"head_dim = {hd} must be a multiple of {fmt.block} (whole {fmt.name} "
                  "blocks)")


def _cache_arrays(k: Kernel, c: Checker, a: dict, lead: tuple[int, ...], hd: int) -> int:
    """K/V cache arrays (each role's rows in its format) and the shadows of the roles
    that keep them; returns max_seq."""
    fmt = k.pair
    kc, vc = a["k_cache"], a["v_cache"]
    ndim = len(lead) + 2
    c.array("k_cache", kc, fmt.k.dtype, ndim)
    c.array("v_cache", vc, fmt.v.dtype, ndim)
    max_seq = int(kc.shape[-2])
    c.shape("k_cache", kc, (*lead, max_seq, fmt.k.row_width(hd)))
    c.shape("v_cache", vc, (*lead, max_seq, fmt.v.row_width(hd)))
    c.require(1 <= max_seq <= INT_MAX, "max_seq", lambda: f"max_seq = {max_seq} out of int range")
    for s in fmt.shadow_buffers():
        rows = getattr(k, s.rows_key)
        c.array(s.name, a[s.name], np.float16, ndim)
        c.shape(s.name, a[s.name], (*lead, rows, hd))
    return max_seq


def _cache_values(k: Kernel, c: Checker, a: dict, values: dict) -> None:
    """The cache arguments, the shadows and their row counts (sink rows, window ring)."""
    values.update(k_cache=a["k_cache"], v_cache=a["v_cache"])
    values.update({s.name: a[s.name] for s in k.pair.shadow_buffers()})
    if k.pair.shadows:
        values["sink"] = c.integer("sink", a.get("sink", 0), 0, k.sink_rows, "sink rows")
        values["win"] = c.integer("win", a.get("win", 0), 0, k.ring_rows, "window ring")
    for name in k.pair.scale_scalars():  # per-tensor scales: rows hold x / scale
        values[name] = _param(c, a, name)
    if quad_reads(k):  # rows read four elements a load (each side's load_key_quad)
        for name, fmt in (("k_cache", k.fmt), ("v_cache", k.v_fmt)):
            _aligned(c, name, a[name], fmt.quad_bytes)


def _block_registers(k: Kernel, c: Checker, threads: int, hd: int | None) -> None:
    """A block of ``threads`` threads gets its registers: the registers ptxas gave one
    of ``k``'s threads (the build's record of the kernel), allocated per warp in the
    target's units, within the target's registers per block (else the launch fails
    with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES). A kernel with no recorded registers
    (the spec's IR, before ptxas) is weighed by the build's limits stage instead."""
    regs = registers(k)
    if regs is None:
        return
    need = TARGET.block_registers(threads, regs)
    if need <= TARGET.registers_per_block:
        return
    per_warp = TARGET.warp_registers(regs)
    warps = TARGET.registers_per_block // per_warp
    at = f"head_dim = {hd}: " if hd is not None else ""
    c.require(False, REGISTERS,
              lambda: f"{at}a block of {threads} threads x {regs} registers a thread (ptxas) "
              f"is allocated {need} registers ({per_warp} a warp, in units of "
              f"{TARGET.register_unit}); {TARGET.arch} allows {TARGET.registers_per_block} a "
              f"block, so at most {warps} warps ({warps * TARGET.warp} threads) of this kernel")


# ---- qz_split -----------------------------------------------------------------

def _qz_split(k: Kernel, c: Checker, a: dict):
    qg, q, z = a["qg"], a["q"], a["z"]
    for name in ("qg", "q", "z"):
        c.array(name, a[name], np.float32)
    hd = int(q.shape[-1]) if q.ndim else 0
    c.require(hd >= 1, "shape", "q must have a last (head_dim) axis")
    c.shape("z", z, tuple(q.shape))
    c.shape("qg", qg, (*q.shape[:-1], 2 * hd))
    total = int(np.prod(q.shape))
    c.require(total >= 1, "shape", "nothing to split")
    blocks = math.ceil(total / QZ_BLOCK)
    _block_registers(k, c, QZ_BLOCK, None)
    c.require(blocks * QZ_BLOCK <= INT_MAX, "int32 index",
              lambda: f"{total} elements overflow the kernel's int thread index")
    values = dict(qg=qg, q=q, z=z, head_dim=hd, total=total)
    return (blocks, 1, 1), (QZ_BLOCK, 1, 1), 0, values


# ---- kv_append ----------------------------------------------------------------

def check_append_shape(k: Kernel, c: Checker, hd: int) -> None:
    """A block is head_dim threads, with the registers they need; rows are whole
    blocks of the format, within a staging format's static bound."""
    _head_dim(k, c, hd, rows=True)
    if k.pair.append_staging:
        c.require(hd <= k.max_head_dim, "static staging",
                  lambda: f"head_dim = {hd} exceeds the kernel's shared staging ({k.max_head_dim})")
    _block_registers(k, c, hd, hd)


def _kv_append(k: Kernel, c: Checker, a: dict):
    fmt = k.pair
    kn, vn = a["k_new"], a["v_new"]
    c.array("k_new", kn, np.float32, 3)
    c.array("v_new", vn, np.float32, 3)
    c.shape("v_new", vn, tuple(kn.shape))
    n, n_head_kv, hd = (int(x) for x in kn.shape)
    check_append_shape(k, c, hd)
    lead = (n, n_head_kv) if k.position is Position.SLOTS else (n_head_kv,)
    max_seq = _cache_arrays(k, c, a, lead, hd)
    values = dict(k_new=kn, v_new=vn, n_head_kv=n_head_kv, head_dim=hd, max_seq=max_seq)
    _cache_values(k, c, a, values)
    if k.position is Position.HOST:
        pos0 = c.integer("pos0", a["pos0"], 0)
        c.require(pos0 + n <= INT_MAX, "int32 position", lambda: "pos0 + n overflows int")
        c.require(n <= max_seq, "ring write race",
                  lambda: f"a batch of {n} rows laps the {max_seq}-row ring inside one launch (two "
                  "blocks write one row)")
        if not fmt.append_wraps:
            c.require(pos0 + n <= max_seq, "no ring wrap",
                      lambda: f"{fmt.name} rows land at pos0 + t without wrapping: pos0 + n = "
                      f"{pos0 + n} > max_seq = {max_seq}")
        values["pos0"] = pos0
    else:
        _positions(k, c, a, n if k.position is Position.SLOTS else 1, max_seq,
                   rows=1 if k.position is Position.SLOTS else n, wrap=fmt.append_wraps)
        values["pos"] = a["pos"]
        if k.position is Position.DEVICE:
            c.require(n == 1, "one decode row",
                      lambda: f"the device-position append writes one row per launch (grid.x = 1); "
                      f"k_new has {n} rows")
    if values.get("win", 0) > 0:
        # Rows t and t + ring_rows of one batch share a ring slot and are written by
        # different blocks: the slot's final content would be a race.
        c.require(n <= k.ring_rows, "ring write race",
                  lambda: f"a batch of {n} rows with win > 0 laps the {k.ring_rows}-row "
                  "fp16 window ring inside one launch (two blocks write one slot); append in "
                  f"chunks of at most {k.ring_rows} rows")
    grid = (n, n_head_kv, 1)
    return grid, (hd, 1, 1), 0, values


def _positions(k: Kernel, c: Checker, a: dict, count: int, max_seq: int, rows: int,
               wrap: bool) -> np.ndarray | None:
    """Device-resident positions: dtype/shape always; values when validate_pos."""
    pos = a["pos"]
    c.array("pos", pos, np.int32, 1)
    c.require(pos.shape[0] >= count, "shape",
              lambda: f"pos has {pos.shape[0]} entries; the launch reads {count}")
    if not a.get("validate_pos", True):
        return None
    host = np.asarray(pos.get() if hasattr(pos, "get") else pos)[:count]
    c.require(bool((host >= 0).all()), "position",
              lambda: f"negative position in pos: {host.min()}")
    if not wrap:
        c.require(int(host.max()) + rows <= max_seq, "no ring wrap",
                  lambda: f"position {int(host.max())} + {rows} row(s) exceeds max_seq = {max_seq}")
    return host


# ---- flash ---------------------------------------------------------------------

def check_flash_shape(k: Kernel, c: Checker, hd: int) -> None:
    """The block is head_dim threads (or that in whole warps); every tile key is
    scored by its own dot lanes. A query_tile block is fixed by its tile shape and
    takes any head_dim its threads' output patches cover. (The block's resources are
    check_flash_groups'.)"""
    if query_tiles(k):
        c.require(1 <= hd <= k.max_head_dim, "head_dim range",
                  lambda: f"head_dim = {hd}: each thread holds its rows' outputs for head_dim "
                  f"up to max_head_dim = {k.max_head_dim} (in {out_cols(k)} columns of "
                  f"{row_lanes(k)} lanes a row)")
        fmt, step = k.pair, head_dim_step(k)
        if step == fmt.block:
            c.require(fmt.accepts_head_dim(hd), "row format",
                      lambda: f"head_dim = {hd} must be a multiple of {fmt.block} (whole "
                      f"{fmt.name} blocks)")
        else:  # float4 reads along head_dim
            c.require(hd >= step and hd % step == 0, "row format",
                      lambda: f"head_dim = {hd} must be a multiple of {step} (whole {fmt.name} "
                      "blocks, read as float4s)")
        return
    threads = block_threads(k, hd)
    c.require(TARGET.fits_block(threads), "block size",
              lambda: f"head_dim = {hd}: a block is {threads} threads, at most "
              f"{TARGET.max_threads}")
    _head_dim(k, c, hd, rows=True)
    if padded(k):
        c.require(hd % k.dot_lanes == 0, "dot chunks",
                  lambda: f"head_dim = {hd}: each of the {k.dot_lanes} dot lanes takes "
                  f"whole chunks (head_dim % {k.dot_lanes} == 0)")
    else:
        c.require(hd % TARGET.warp == 0, "whole warps",
                  lambda: f"head_dim = {hd}: the dot shuffles use full-warp masks, so a "
                  f"block must be whole warps (head_dim % {TARGET.warp} == 0; threads = warps "
                  "pads it)")
    tt = tile_threads(k)
    c.require(threads >= tt, "every key scored",
              lambda: f"head_dim = {hd}: {threads} threads < tile_keys * dot_lanes = {tt}: thread "
              f"ky = tid / {k.dot_lanes} scores key ky, so keys {threads // k.dot_lanes}.."
              f"{k.tile_keys - 1} of each tile would keep stale scores")
    if stream_hoisted(k):
        c.require(hd == stream_head_dim(k), "hoisted chunk",
                  lambda: f"head_dim = {hd}: stream_loads = hoisted fixes each lane's chunk at "
                  f"kreg_max_chunk = {k.kreg_max_chunk}, so head_dim = {stream_head_dim(k)}")
    if k.k_stage is KStage.REGISTERS:
        c.require(hd <= k.kreg_max_chunk * k.dot_lanes, "register K chunk",
                  lambda: f"head_dim = {hd} > kreg_max_chunk * dot_lanes = "
                  f"{k.kreg_max_chunk * k.dot_lanes}: K would not fit the register chunk")
    if k.v_stage is VStage.SHARED_Q4:
        c.require(hd == tt, "shared-V shape",
                  lambda: f"the shared-V tile is sized for head_dim = {tt}, not {hd}")


def _attention_scalars(k: Kernel, c: Checker, a: dict, values: dict, hd: int) -> None:
    """The window (tile-granular or key-exact), the scale and the soft-cap a flash
    kernel takes, each in its range (and finite in float32)."""
    values["attn_sink"] = _param(c, a, "attn_sink")
    if k.window is Window.EXACT:
        values["win_left"] = _param(c, a, "win_left")
        values["win_right"] = _param(c, a, "win_right")
    else:
        values["attn_win"] = _param(c, a, "attn_win")
    values["scale"] = _param(c, a, "scale", 1.0 / math.sqrt(hd))
    if k.softcap is SoftCap.TANH:
        values["softcap"] = _param(c, a, "softcap")


def check_flash_groups(k: Kernel, c: Checker, G: int, hd: int) -> int:
    """kv_groups within the compile-time bound, and the block's resources fit the
    target: the shared memory it needs (returns that many bytes), then its
    registers (checked last: a shape an axis contract refuses is refused as such)."""
    c.require(1 <= G <= k.max_groups, "kv_groups",
              lambda: f"kv_groups = {G} exceeds the compile-time bound max_groups = {k.max_groups}")
    smem = flash_shared_bytes(k, G * k.rows_per_block, hd)  # a block stages every row's q
    limit = TARGET.shared_per_block
    c.require(smem <= limit, "shared memory",
              lambda: f"needs {smem} bytes of shared memory (kv_groups {G}, head_dim "
              f"{hd}); a block may use {limit}")
    _block_registers(k, c, block_threads(k, hd), hd)
    return smem


def shape_error(k: Kernel, head_dim: int, groups: int = 1) -> ContractError | None:
    """The contract ``k`` breaks at ``head_dim`` with ``groups`` q heads per KV head,
    or None: the launch contracts that depend on shapes alone (block size and
    registers, row format, tiles, shared memory), for choosing a kernel before any
    array exists."""
    c = Checker(k.name)
    try:
        if k.op is Op.FLASH:
            check_flash_shape(k, c, head_dim)
            check_flash_groups(k, c, groups, head_dim)
        elif k.op is Op.KV_APPEND:
            check_append_shape(k, c, head_dim)
        elif k.op is Op.DECODE_COMBINE:
            check_combine_shape(k, c, head_dim)
        elif k.op is Op.MERGE_ATTN_STATES:  # a warp per row strides any head_dim
            c.require(head_dim >= 1, "shape", lambda: f"head_dim = {head_dim}: nothing to merge")
        elif k.op in MLA_OPS:  # one latent row width, fixed at compile time
            want = ops.get(k.op).mla_width()
            c.require(head_dim == want, "shape", lambda: f"head_dim = {head_dim}: {k.op.value} "
                      f"serves rows of {want} only")
        elif k.op in (Op.DFLASH_ATTENTION, Op.DENSE_ATTENTION):  # a warp's rows
            check_dflash_shape(k, c, head_dim)
        else:
            _head_dim(k, c, head_dim, rows=False)
    except ContractError as exc:
        return exc
    return None


def shape_refusal(k: Kernel, head_dim: int, groups: int = 1) -> str | None:
    """Why ``k`` cannot run ``head_dim`` with ``groups`` q heads per KV head (the
    contract's message, :func:`shape_error`), or None."""
    exc = shape_error(k, head_dim, groups)
    return None if exc is None else str(exc)


def _prefill_out(k: Kernel, c: Checker, a: dict, values: dict, rows: int, n_head: int,
                 hd: int) -> int:
    """A prefill's outputs, checked into ``values``: out [rows][n_head][head_dim], or
    (key_split = partials) the (m, l, acc) partials of rows * n_head combine heads x
    n_splits (acc x head_dim); returns the split count (1: the whole form)."""
    if not key_partials(k):
        c.array("out", a["out"], np.float32, 3)
        c.shape("out", a["out"], (rows, n_head, hd))
        values["out"] = a["out"]
        return 1
    splits = c.integer("n_splits", a["n_splits"], 1)
    _partials(c, a, PARTIALS_OUT, rows * n_head, splits, hd, detail=True)
    values.update(m_out=a["m_out"], l_out=a["l_out"], acc_out=a["acc_out"], n_splits=splits)
    return splits


PARTIALS_OUT = ("m_out", "l_out", "acc_out")  # a split kernel's partials
PARTIALS_IN = ("m_in", "l_in", "acc_in")      # the combine's


def _partials(c: Checker, a: dict, names: tuple[str, str, str], heads: int, width: int,
              hd: int, detail: bool = False) -> None:
    """Split partials (m, l, acc: ``names``) of ``heads`` heads x ``width`` splits: float32
    arrays of at least heads * width floats (acc: x head_dim)."""
    m, l, acc = names  # noqa: E741
    for name in names:
        c.array(name, a[name], np.float32)
    c.require(a[m].size >= heads * width and a[l].size >= heads * width, "partials size",
              lambda: f"{m}/{l} need {heads * width} floats"
              + (f" ({heads} heads x {width} splits)" if detail else ""))
    c.require(a[acc].size >= heads * width * hd, "partials size",
              lambda: f"{acc} needs {heads * width * hd} floats")


def _flash(k: Kernel, c: Checker, a: dict):
    prefill = k.mode is Mode.PREFILL
    slots = k.position is Position.SLOTS
    q = a["q"]
    c.array("q", q, np.float32, 3 if (prefill or slots) else 2)
    hd = int(q.shape[-1])
    n_head = int(q.shape[-2])
    lead_q = tuple(int(x) for x in q.shape[:-2])  # (n,) prefill, (nslots,) slots, () decode
    kc = a["k_cache"]
    c.require(hasattr(kc, "shape") and kc.ndim >= 3, "shape",
              "k_cache must be [n_head_kv][max_seq][row] (per slot: [nslots][...])")
    n_head_kv = int(kc.shape[-3])
    lead = (lead_q[0], n_head_kv) if slots else (n_head_kv,)

    check_flash_shape(k, c, hd)
    c.require(n_head_kv >= 1 and n_head % n_head_kv == 0, "GQA",
              lambda: f"n_head = {n_head} is not a multiple of n_head_kv = {n_head_kv}")
    G = n_head // n_head_kv
    smem = check_flash_groups(k, c, G, hd)

    max_seq = _cache_arrays(k, c, a, lead, hd)
    values = dict(q=q, kv_groups=G, head_dim=hd, max_seq=max_seq)
    _cache_values(k, c, a, values)
    _attention_scalars(k, c, a, values, hd)
    if k.sinks is Sinks.LEARNED:
        values["sinks"] = _sinks(c, a, (lead_q[0] if slots and not prefill else 1) * n_head)

    if prefill:
        n = lead_q[0]
        splits = _prefill_out(k, c, a, values, n, n_head, hd)
        pos0 = c.integer("pos0", a["pos0"], 0)
        c.require(pos0 + n <= max_seq, "no ring wrap",
                  lambda: f"query rows read cache rows [0, pos0 + n) = [0, {pos0 + n}) without "
                  f"wrapping; max_seq = {max_seq}")
        values.update(pos0=pos0)
        if k.rows_per_block > 1 or query_tiles(k):
            values["n_rows"] = n
        if query_tiles(k):  # rows (query, q head) of a kv head, and a tile past them, in int
            c.require(n * G <= INT_MAX - k.tile_rows, "int32 index",
                      lambda: f"{n} query rows x {G} q heads overflow the kernel's int row index")
        return (prefill_grid(k, n, G, n_head_kv, splits), (block_threads(k, hd), 1, 1), smem,
                values)

    heads = (lead_q[0] if slots else 1) * n_head
    if k.position is Position.HOST:
        seq_len = c.integer("seq_len", a["seq_len"], 1, max_seq, "no ring wrap")
        n_splits = c.integer("n_splits", a["n_splits"], 1)
        split_len = c.integer("split_len", a["split_len"], 1)
        c.require(split_len % k.tile_keys == 0, "split plan",
                  lambda: f"split_len = {split_len} must be whole tiles of {k.tile_keys}")
        c.require(n_splits == -(-seq_len // split_len), "split plan",
                  lambda: f"n_splits = {n_splits} does not cover seq_len = {seq_len} in splits of "
                  f"{split_len} (expected {-(-seq_len // split_len)})")
        width = n_splits
        grid = (n_splits, n_head_kv, 1)
        values.update(seq_len=seq_len, n_splits=n_splits, split_len=split_len)
    else:
        kps = c.integer("kps", a["kps"], 1)
        cap = c.integer("splits_cap", a["splits_cap"], 1)
        values.update(kps=kps, splits_cap=cap, pos=a["pos"])
        count = lead_q[0] if slots else 1
        host = _positions(k, c, a, count, max_seq, rows=1, wrap=False)
        width = cap
        if slots:
            width = a.get("launch_splits") or cap
            width = c.integer("launch_splits", width, 1)
            if host is not None:
                need = max(decode_plan(int(p) + 1, kps, cap, k.tile_keys).n_splits
                           for p in host)
                c.require(width >= need, "slot plan coverage",
                          lambda: f"launch_splits = {width} < {need}, the longest slot's plan: its "
                          "later splits would never be computed")
            grid = (width, n_head_kv, lead_q[0])
        else:
            grid = (cap, n_head_kv, 1)
            if host is not None:  # partials are strided by the live plan's n_splits
                width = decode_plan(int(host[0]) + 1, kps, cap, k.tile_keys).n_splits
    # Partials are strided by the live split count; size them for the widest.
    _partials(c, a, PARTIALS_OUT, heads, width, hd, detail=True)
    values.update(m_out=a["m_out"], l_out=a["l_out"], acc_out=a["acc_out"])
    return grid, (block_threads(k, hd), 1, 1), smem, values


# ---- decode combine --------------------------------------------------------------

def _float32(c: Checker, name: str, v, default: float, positive: bool = False,
             lo: float = 0) -> float:
    """A float scalar as the kernel receives it: finite in float32 (and > lo, or >= lo)."""
    v = default if v is None else v
    c.require(isinstance(v, int | float | np.floating) and not isinstance(v, bool), "type",
              lambda: f"{name} must be a number, not {v!r}")
    with np.errstate(over="ignore"):
        f32 = float(np.float32(v))
    ok = math.isfinite(f32) and (f32 > lo if positive else f32 >= lo)
    c.require(ok, name, lambda: f"{name} = {v!r} must be finite in float32 and "
              f"{'>' if positive else '>='} {lo}")
    return float(v)


def _param(c: Checker, a: dict, name: str, unset: float | None = None):
    """A parameter the caller may leave out (kgen.ir.params): its default when it is
    not given (``unset`` where the default is None), checked in its range."""
    p = PARAMS[name]
    v = a.get(name, p.default)
    if p.kind is int:
        return c.integer(name, v, p.lo, p.hi)
    return _float32(c, name, v, unset if p.default is None else p.default, p.positive,
                    p.lo)


def _sinks(c: Checker, a: dict, heads: int):
    """One learned sink logit per q head (float32; -inf is no sink)."""
    s = a["sinks"]
    c.array("sinks", s, np.float32, 1)
    c.shape("sinks", s, (heads,))
    return s


def check_combine_shape(k: Kernel, c: Checker, hd: int) -> None:
    """A serial combine block is head_dim threads, a staged one COMBINE_THREADS (a block
    per COMBINE_DIMS dims, any head_dim), with the registers they need."""
    if combine_staged(k):  # any head_dim: a block per COMBINE_DIMS dims (grid y, checked)
        c.require(hd >= 1, "shape", lambda: f"head_dim = {hd}: nothing to combine")
    else:
        _head_dim(k, c, hd, rows=False)
    _block_registers(k, c, combine_threads(k, hd), hd)


def _combine(k: Kernel, c: Checker, a: dict):
    out = a["out"]
    c.array("out", out, np.float32, 2)
    heads, hd = (int(x) for x in out.shape)
    check_combine_shape(k, c, hd)
    for name in ("m_in", "l_in", "acc_in"):
        c.array(name, a[name], np.float32)
    values = dict(m_in=a["m_in"], l_in=a["l_in"], acc_in=a["acc_in"], out=out, head_dim=hd)
    if k.sinks is Sinks.LEARNED:
        values["sinks"] = _sinks(c, a, heads)
    if k.position is Position.HOST:
        width = c.integer("n_splits", a["n_splits"], 1)
        values["n_splits"] = width
    else:
        values["kps"] = c.integer("kps", a["kps"], 1)
        values["splits_cap"] = width = c.integer("splits_cap", a["splits_cap"], 1)
        values["pos"] = a["pos"]
        host = _positions(k, c, a, 1, INT_MAX, rows=1, wrap=True)
        if host is not None:  # the live plan: partials are strided by its n_splits
            width = decode_plan(int(host[0]) + 1, values["kps"], width, k.tile_keys).n_splits
    _partials(c, a, PARTIALS_IN, heads, width, hd)
    return combine_grid(k, heads, hd), (combine_threads(k, hd), 1, 1), 0, values


# ---- merge_attn_states -------------------------------------------------------------
# The engine's MergeAttnStates: output, prefix_output and suffix_output are
# [n_tokens][n_head][head_dim] f32; prefix_lse, suffix_lse (and output_lse, lse = write)
# [n_head][n_tokens] f32, every array C-contiguous. A warp merges one (token, head) row.

MERGE_LSES = ("prefix_lse", "suffix_lse")


def _elem(dtype) -> np.dtype:
    """The NumPy dtype of an op's in_dtype / out_dtype arrays (the format's elements)."""
    return np.dtype(dtype.fmt.dtype)


def _merge(k: Kernel, c: Checker, a: dict):
    out = a["output"]
    c.array("output", out, _elem(k.out_dtype), 3)
    T, H, D = (int(x) for x in out.shape)
    c.require(T >= 1 and H >= 1 and D >= 1, "shape",
              lambda: f"output has shape {(T, H, D)}: nothing to merge")
    for name in ("prefix_output", "suffix_output"):
        c.array(name, a[name], _elem(k.in_dtype), 3)
        c.shape(name, a[name], (T, H, D))
    lses = (*MERGE_LSES, "output_lse") if k.lse is Lse.WRITE else MERGE_LSES
    for name in lses:
        x = a[name]
        c.array(name, x, np.float32, 2)
        c.require(tuple(x.shape) == (H, T), "lse layout",
                  lambda x=x, name=name: f"{name} has shape {tuple(x.shape)}; the LSE layout is "
                  f"[n_head][n_tokens] = {(H, T)}" + (" (this is [n_tokens][n_head]: pass its "
                                                      "transpose, made contiguous)"
                                                      if tuple(x.shape) == (T, H) else ""))
    c.require(T * H <= INT_MAX - MERGE_ROWS, "int32 index",
              lambda: f"{T} tokens x {H} heads overflow the kernel's int row index")
    values = {name: a[name] for name in ("output", *lses, "prefix_output", "suffix_output")}
    values.update(n_tokens=T, n_head=H, head_dim=D,
                  prefill_tokens_with_context=_param(c, a, "prefill_tokens_with_context"))
    return merge_grid(T, H), (merge_threads(), 1, 1), 0, values


# ---- dflash_attention ------------------------------------------------------------------
# The engine's DFlash block attention. query and out are [n_rows][n_head][head_dim];
# dense: key / value [n_rows][n_head_kv][head_dim]; paged: block_key / block_value alike,
# ctx_key / ctx_value pages [num_pages][block_size][n_head_kv][head_dim]; out of the
# kernel's out_dtype, query and every key / value array of its in_dtype;
# seq_lens [num_reqs] and block_table [num_reqs][max_blocks] int32. cu_seqlens
# [num_reqs + 1] int32. Every array C-contiguous. The index tensors are read in place by
# the kernel (never by the host: the launch can be captured), which writes zeros to
# rows outside every request and NaN to rows of a request whose entries break the
# contract (kgen.runtime.dflash checks them on the host first, unless told not to).

def check_dflash_shape(k: Kernel, c: Checker, hd: int) -> None:
    """A lane holds dflash_chunks(k) dims of a row: head_dim within max_head_dim."""
    c.require(1 <= hd <= k.max_head_dim, "head_dim range",
              lambda: f"head_dim = {hd}: a warp holds rows of 1..max_head_dim = "
              f"{k.max_head_dim} dims")


def _dflash(k: Kernel, c: Checker, a: dict):
    paged = k.key_source is KeySource.PAGED
    fi, fo = _elem(k.in_dtype), _elem(k.out_dtype)
    q = a["query"]
    c.array("query", q, fi, 3)
    T, H, D = (int(x) for x in q.shape)
    c.require(T >= 1 and H >= 1 and D >= 1, "shape",
              lambda: f"query has shape {(T, H, D)}: no rows to attend")
    check_dflash_shape(k, c, D)
    c.array("out", a["out"], fo, 3)
    c.shape("out", a["out"], (T, H, D))
    kn, vn = ("block_key", "block_value") if paged else ("key", "value")
    c.array(kn, a[kn], fi, 3)
    hk = int(a[kn].shape[1])
    c.require(hk >= 1, "shape", lambda: f"{kn} has no kv heads")
    c.shape(kn, a[kn], (T, hk, D))
    c.array(vn, a[vn], fi, 3)
    c.shape(vn, a[vn], (T, hk, D))
    c.require(H % hk == 0, "GQA", lambda: f"n_head = {H} is not a multiple of "
              f"n_head_kv = {hk}")
    cu = a["cu_seqlens"]
    c.array("cu_seqlens", cu, np.int32, 1)
    reqs = int(cu.shape[0]) - 1
    c.require(reqs >= 1, "shape", "cu_seqlens needs num_reqs + 1 entries")
    c.require(T * H <= INT_MAX - DFLASH_ROWS, "int32 index",
              lambda: f"{T} rows x {H} heads overflow the kernel's int row index")
    values = dict(out=a["out"], query=q, cu_seqlens=cu, n_rows=T, n_head=H, n_head_kv=hk,
                  head_dim=D, num_reqs=reqs)
    values[kn], values[vn] = a[kn], a[vn]
    if paged:
        ck, cv = a["ctx_key"], a["ctx_value"]
        c.array("ctx_key", ck, fi, 4)
        c.array("ctx_value", cv, fi, 4)
        nb, bs = int(ck.shape[0]), int(ck.shape[1])
        c.shape("ctx_key", ck, (nb, bs, hk, D))
        c.shape("ctx_value", cv, (nb, bs, hk, D))
        c.require(nb >= 1 and bs >= 1, "shape", "empty context pages")
        c.require(nb * bs <= INT_MAX, "int32 position", lambda: f"{nb} pages of {bs} "
                  "positions overflow an int position")
        _index(c, a, "seq_lens", (reqs,))
        bt = a["block_table"]
        c.array("block_table", bt, np.int32, 2)
        c.require(int(bt.shape[0]) == reqs, "shape", lambda: f"block_table has "
                  f"{bt.shape[0]} rows for {reqs} requests")
        mb = int(bt.shape[1])
        c.require(mb >= 1, "shape", "block_table has no columns")
        c.require(mb * bs + T + k.keys_per_step <= INT_MAX, "int32 position",
                  lambda: f"{mb} blocks of {bs} context positions and {T} block rows "
                  f"(and a step of {k.keys_per_step} keys) overflow an int position")
        values.update(ctx_key=ck, ctx_value=cv, seq_lens=a["seq_lens"], block_table=bt,
                      block_size=bs, max_blocks=mb, num_pages=nb)
    values.update(block_causal=_param(c, a, "block_causal"),
                  sliding_window=_param(c, a, "sliding_window"),
                  scale=_param(c, a, "scale", 1.0 / math.sqrt(D)))
    return dflash_grid(T, H), (dflash_threads(), 1, 1), 0, values


# ---- dense_attention -----------------------------------------------------------------
# The engine's Attention over one sequence (AttentionDenseFast, AttentionDenseFlash):
# query [n_rows][n_head][head_dim] and key / value [n_rows][n_head_kv][head_dim] of
# in_dtype, out [n_rows][n_head][head_dim] of out_dtype, every array C-contiguous; a warp
# per (query row, q head), its head_dim within max_head_dim (check_dflash_shape: the
# same warp's registers); the tiles of shared_tile are static shared memory.

def _dense(k: Kernel, c: Checker, a: dict):
    fi, fo = k.in_dtype.fmt, k.out_dtype.fmt
    q = a["query"]
    c.array("query", q, np.dtype(fi.dtype), 3)
    T, H, D = (int(x) for x in q.shape)
    c.require(T >= 1 and H >= 1 and D >= 1, "shape",
              lambda: f"query has shape {(T, H, D)}: no rows to attend")
    check_dflash_shape(k, c, D)
    c.array("out", a["out"], np.dtype(fo.dtype), 3)
    c.shape("out", a["out"], (T, H, D))
    c.array("key", a["key"], np.dtype(fi.dtype), 3)
    hk = int(a["key"].shape[1])
    c.require(hk >= 1, "shape", lambda: "key has no kv heads")
    c.shape("key", a["key"], (T, hk, D))
    c.array("value", a["value"], np.dtype(fi.dtype), 3)
    c.shape("value", a["value"], (T, hk, D))
    c.require(H % hk == 0, "GQA", lambda: f"n_head = {H} is not a multiple of "
              f"n_head_kv = {hk}")
    c.require(T * H <= INT_MAX - DENSE_ROWS, "int32 index",
              lambda: f"{T} rows x {H} heads overflow the kernel's int row index")
    values = dict(out=a["out"], query=q, key=a["key"], value=a["value"], n_rows=T,
                  n_head=H, n_head_kv=hk, head_dim=D,
                  block_causal=_param(c, a, "block_causal"),
                  scale=_param(c, a, "scale", 1.0 / math.sqrt(D)))
    return dense_grid(T, H, hk), (dense_threads(), 1, 1), 0, values


# ---- paged caches (position = paged) --------------------------------------------------
# Pages are [num_blocks][block_size][n_head_kv][row]; a request's block-table row maps
# its logical blocks to physical ones. The host passes shapes and upper bounds only:
# with validate_pos (the default) it also reads the index tensors back and checks
# them; a graph-captured launch passes validate_pos=False and owns their values.


def _pages(k: Kernel, c: Checker, a: dict, hd: int) -> tuple[int, int, int]:
    """The paged K/V caches; returns (num_blocks, block_size, n_head_kv)."""
    fmt = k.pair
    kc, vc = a["k_cache"], a["v_cache"]
    c.array("k_cache", kc, fmt.k.dtype, 4)
    c.array("v_cache", vc, fmt.v.dtype, 4)
    nb, bs, hk = (int(x) for x in kc.shape[:3])
    c.shape("k_cache", kc, (nb, bs, hk, fmt.k.row_width(hd)))
    c.shape("v_cache", vc, (nb, bs, hk, fmt.v.row_width(hd)))
    c.require(nb >= 1 and bs >= 1 and hk >= 1, "shape", "empty paged cache")
    widest = max(fmt.k.row_width(hd), fmt.v.row_width(hd))
    c.require(nb * bs * hk * widest < 2**62, "int64 index", "cache too large")
    c.require(nb * bs <= INT_MAX, "int32 position", lambda: f"{nb} blocks of {bs} positions "
              "overflow an int position")
    return nb, bs, hk


def _index(c: Checker, a: dict, name: str, shape: tuple[int, ...]) -> object:
    c.array(name, a[name], np.int32, len(shape))
    c.shape(name, a[name], shape)
    return a[name]


def _host_ints(x) -> np.ndarray:
    return np.asarray(x.get() if hasattr(x, "get") else x)


def _paged_tables(k: Kernel, c: Checker, a: dict, nb: int, bs: int, reqs: int) -> int:
    """block_table [num_reqs][max_blocks] and seq_lens [num_reqs]; returns max_blocks."""
    bt = a["block_table"]
    c.array("block_table", bt, np.int32, 2)
    c.require(int(bt.shape[0]) == reqs, "shape", lambda: f"block_table has {bt.shape[0]} "
              f"rows for {reqs} requests")
    mb = int(bt.shape[1])
    c.require(mb >= 1, "shape", "block_table has no columns")
    _index(c, a, "seq_lens", (reqs,))
    if a.get("validate_pos", True):
        lens = _host_ints(a["seq_lens"])
        table = _host_ints(bt)
        c.require(bool((lens >= 1).all()), "seq_lens", lambda: f"seq_lens must be >= 1, "
                  f"got {lens.min()}")
        c.require(bool((lens <= mb * bs).all()), "seq_lens", lambda: f"a sequence of "
                  f"{lens.max()} keys needs more than the table's {mb} blocks of {bs}")
        for r, n in enumerate(lens):
            used = table[r, : -(-int(n) // bs)]
            c.require(bool(((used >= 0) & (used < nb)).all()), "block_table",
                      lambda r=r: f"request {r} maps a block outside [0, {nb})")
    return mb


def _paged_flash(k: Kernel, c: Checker, a: dict):
    prefill = k.mode is Mode.PREFILL
    q = a["q"]
    c.array("q", q, np.float32, 3)
    rows, n_head, hd = (int(x) for x in q.shape)
    check_flash_shape(k, c, hd)
    nb, bs, hk = _pages(k, c, a, hd)
    c.require(n_head % hk == 0, "GQA", lambda: f"n_head = {n_head} is not a multiple of "
              f"n_head_kv = {hk}")
    G = n_head // hk
    smem = check_flash_groups(k, c, G, hd)
    values = dict(q=q, k_cache=a["k_cache"], v_cache=a["v_cache"], kv_groups=G, head_dim=hd,
                  block_size=bs)
    _cache_values(k, c, a, values)
    _attention_scalars(k, c, a, values, hd)
    if prefill:
        qsl = a["query_start_loc"]
        c.array("query_start_loc", qsl, np.int32, 1)
        reqs = int(qsl.shape[0]) - 1
        c.require(reqs >= 1, "shape", "query_start_loc needs num_reqs + 1 entries")
        mb = _paged_tables(k, c, a, nb, bs, reqs)
        qlen = None
        if a.get("validate_pos", True):
            starts, lens = _host_ints(qsl), _host_ints(a["seq_lens"])
            qlen = np.diff(starts)
            c.require(int(starts[0]) == 0 and int(starts[-1]) == rows and
                      bool((qlen >= 0).all()), "query_start_loc",
                      lambda: f"query_start_loc must rise from 0 to the {rows} rows of q")
            c.require(bool((qlen <= lens).all()), "query_start_loc",
                      "a request has more query rows than keys (seq_lens)")
        splits = _prefill_out(k, c, a, values, rows, n_head, hd)
        if k.sinks is Sinks.LEARNED:
            values["sinks"] = _sinks(c, a, n_head)
        values.update(block_table=a["block_table"], seq_lens=a["seq_lens"],
                      query_start_loc=qsl, max_blocks=mb, num_reqs=reqs)
        c.require(rows >= 1, "shape", "no query rows")
        # The host's bound on one request's query rows (the grid of a query_tile form).
        mq = c.integer("max_query_len", a.get("max_query_len") or rows, 1, rows,
                       "max_query_len")
        if qlen is not None:
            most = int(qlen.max())
            c.require(most <= mq, "max_query_len", lambda: f"a request has {most} query "
                      f"rows, above max_query_len = {mq}")
        if query_tiles(k):  # rows (query, q head) of a kv head, and a tile past them, in int
            c.require(mq * G <= INT_MAX - k.tile_rows, "int32 index",
                      lambda: f"{mq} query rows x {G} q heads overflow the kernel's int row "
                      "index")
        return (paged_prefill_grid(k, rows, mq, G, hk, reqs, splits),
                (block_threads(k, hd), 1, 1), smem, values)
    reqs = rows
    mb = _paged_tables(k, c, a, nb, bs, reqs)
    kps = c.integer("kps", a["kps"], 1)
    cap = c.integer("splits_cap", a["splits_cap"], 1)
    bound = c.integer("max_seq_len", a.get("max_seq_len") or mb * bs, 1, mb * bs,
                      "max_seq_len")
    if a.get("validate_pos", True):
        lens = _host_ints(a["seq_lens"])
        c.require(int(lens.max()) <= bound, "max_seq_len", lambda: f"a request has "
                  f"{int(lens.max())} keys, above max_seq_len = {bound}")
    # Every request's plan has at most min(ceil(bound / kps), cap) splits: the width.
    width = min(max(-(-bound // kps), 1), cap)
    heads = reqs * n_head
    _partials(c, a, PARTIALS_OUT, heads, width, hd)
    values.update(m_out=a["m_out"], l_out=a["l_out"], acc_out=a["acc_out"],
                  block_table=a["block_table"], seq_lens=a["seq_lens"], max_blocks=mb,
                  kps=kps, splits_cap=cap)
    return (width, hk, reqs), (block_threads(k, hd), 1, 1), smem, values


def _slots_within(c: Checker, sm, positions: int) -> None:
    """A store's slot_mapping, read back: every slot below ``positions`` (negative ones
    skip), no two tokens on one slot."""
    slots = _host_ints(sm)
    c.require(bool((slots < positions).all()), "slot_mapping", lambda: f"a slot beyond the "
              f"{positions} positions of the pages")
    live = slots[slots >= 0]
    c.require(len(set(live.tolist())) == live.size, "slot_mapping",
              "two tokens map to one slot (two blocks would race for it)")


def _paged_append(k: Kernel, c: Checker, a: dict):
    kn, vn = a["k_new"], a["v_new"]
    c.array("k_new", kn, np.float32, 3)
    c.array("v_new", vn, np.float32, 3)
    c.shape("v_new", vn, tuple(kn.shape))
    n, hk, hd = (int(x) for x in kn.shape)
    check_append_shape(k, c, hd)
    nb, bs, hk_c = _pages(k, c, a, hd)
    c.require(hk_c == hk, "shape", lambda: f"k_new has {hk} kv heads, the cache {hk_c}")
    sm = _index(c, a, "slot_mapping", (n,))
    if a.get("validate_pos", True):
        _slots_within(c, sm, nb * bs)
    values = dict(k_new=kn, v_new=vn, k_cache=a["k_cache"], v_cache=a["v_cache"],
                  slot_mapping=sm, n_head_kv=hk, head_dim=hd)
    _cache_values(k, c, a, values)
    return (n, hk, 1), (hd, 1, 1), 0, values


# ---- multi-head latent attention --------------------------------------------------------
# The latent cache is pages [num_blocks][block_size][MLA_ROW] of the kernel's in_dtype
# (its kv_c / k_pe rows, queries and prefill q, K, V alike; outputs of out_dtype; the
# partials and every LSE f32), one KV head, V the
# first MLA_LATENT columns of each row. The index tensors are device tensors the kernels
# read in place; with validate_pos (the default) the host reads them back and checks
# them, a graph-captured launch passes validate_pos=False and owns their values (the
# kernels skip a slot, table entry or token that points outside the arrays).


MLA_ALIGN = 16  # bytes: the gather and the decode move latent rows as 16-byte quads (f32),
#                 the 16-bit kernels as 8-byte quads of elements (16 bytes asked alike)


def _aligned(c: Checker, name: str, x, align: int = MLA_ALIGN) -> None:
    """A device array the kernel reads or writes ``align`` bytes a load (MLA: float4s)
    starts on an ``align``-byte boundary (its rows keep every row there); checked where
    the array tells its address."""
    ptr = getattr(getattr(x, "data", None), "ptr", None)
    c.require(ptr is None or int(ptr) % align == 0, "alignment",
              lambda: f"{name} must start on a {align}-byte boundary (address {ptr:#x})")


def _latent_pages(k: Kernel, c: Checker, name: str, x) -> tuple[int, int]:
    """The paged latent cache [num_blocks][block_size][MLA_ROW] of in_dtype; (num_blocks,
    block_size)."""
    c.array(name, x, _elem(k.in_dtype), 3)
    nb, bs = (int(n) for n in x.shape[:2])
    c.shape(name, x, (nb, bs, MLA_ROW))
    c.require(nb >= 1 and bs >= 1, "shape", "empty paged cache")
    c.require(nb * bs <= INT_MAX, "int32 position", lambda: f"{nb} blocks of {bs} positions "
              "overflow an int position")
    return nb, bs


def _source_rows(c: Checker, name: str, x, width: int, dtype: np.dtype) -> tuple[int, int]:
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
    c.require(int(strides[1]) == item and row % item == 0 and (rows <= 1 or row >= width * item),
              "contiguous", lambda: f"{name} must have adjacent elements along a row and rows "
              f"at least {width} elements apart (strides {tuple(strides)})")
    stride = row // item if rows > 1 else width
    c.require(stride <= INT_MAX, "int32 index", lambda: f"{name}'s row stride {stride} "
              "overflows an int")
    return rows, stride


def _mla_store(k: Kernel, c: Checker, a: dict):
    T, kv_stride = _source_rows(c, "kv_c", a["kv_c"], MLA_LATENT, _elem(k.in_dtype))
    T_pe, pe_stride = _source_rows(c, "k_pe", a["k_pe"], MLA_ROPE, _elem(k.in_dtype))
    c.require(T_pe == T, "shape", lambda: f"k_pe has {T_pe} rows, kv_c {T}")
    nb, bs = _latent_pages(k, c, "kv_cache", a["kv_cache"])
    sm = a["slot_mapping"]
    c.array("slot_mapping", sm, np.int64, 1)
    S = int(sm.shape[0])
    c.require(1 <= S <= T, "shape", lambda: f"slot_mapping has {S} slots for {T} tokens "
              "(1 <= S <= T: the tail past S is padding)")
    if a.get("validate_pos", True):
        _slots_within(c, sm, nb * bs)
    values = dict(kv_c=a["kv_c"], k_pe=a["k_pe"], kv_cache=a["kv_cache"], slot_mapping=sm,
                  n_slots=S, kv_c_stride=kv_stride, k_pe_stride=pe_stride, num_blocks=nb,
                  block_size=bs)
    return mla_store_grid(S), (MLA_STORE_THREADS, 1, 1), 0, values


def _mla_tables(c: Checker, a: dict, reqs: int | None) -> tuple[int, int]:
    """block_table [num_reqs][max_blocks] int32 (num_reqs: its rows where ``reqs`` is
    None); (num_reqs, max_blocks)."""
    bt = a["block_table"]
    c.array("block_table", bt, np.int32, 2)
    rows, mb = (int(n) for n in bt.shape)
    if reqs is not None:
        c.require(rows == reqs, "shape", lambda: f"block_table has {rows} rows for {reqs} "
                  "requests")
    c.require(rows >= 1 and mb >= 1, "shape", lambda: f"block_table has shape {(rows, mb)}")
    return rows, mb


def _mla_used_blocks(c: Checker, table: np.ndarray, r: int, first: int, last: int,
                     nb: int, bs: int) -> None:
    """Request ``r`` reads rows [first, last): its table maps each of their blocks."""
    mb = table.shape[1]
    c.require(last <= mb * bs, "block_table", lambda: f"request {r} reads row {last - 1}, "
              f"past its table's {mb} blocks of {bs}")
    used = table[r, first // bs: -(-last // bs)]
    c.require(bool(((used >= 0) & (used < nb)).all()), "block_table",
              lambda: f"request {r} maps a block outside [0, {nb})")


def _mla_gather(k: Kernel, c: Checker, a: dict):
    dst = a["dst"]
    c.array("dst", dst, _elem(k.in_dtype), 2)
    rows = int(dst.shape[0])
    c.shape("dst", dst, (rows, MLA_ROW))
    _aligned(c, "dst", dst)
    nb, bs = _latent_pages(k, c, "src_cache", a["src_cache"])
    _aligned(c, "src_cache", a["src_cache"])
    reqs, mb = _mla_tables(c, a, None)
    _index(c, a, "cu_seq_lens", (reqs + 1,))
    t2s = a["token_to_seq"]
    c.array("token_to_seq", t2s, np.int32, 1)
    given = k.seq_starts is SeqStarts.GIVEN
    if given:
        _index(c, a, "seq_starts", (reqs,))
    n = c.integer("num_tokens", a["num_tokens"], 1, INT_MAX - 32)
    c.require(n <= rows, "shape", lambda: f"num_tokens = {n}: dst holds {rows} rows")
    c.require(n <= int(t2s.shape[0]), "shape", lambda: f"num_tokens = {n}: token_to_seq "
              f"holds {int(t2s.shape[0])} entries")
    if a.get("validate_pos", True):
        cu = _host_ints(a["cu_seq_lens"]).astype(np.int64)
        c.require(int(cu[0]) == 0 and bool((np.diff(cu) >= 0).all()), "cu_seq_lens",
                  "cu_seq_lens must rise from 0")
        seqs = _host_ints(t2s)[:n].astype(np.int64)
        at = np.arange(n)
        ok = (seqs >= 0) & (seqs < reqs)
        ok[ok] &= (cu[seqs[ok]] <= at[ok]) & (at[ok] < cu[seqs[ok] + 1])
        c.require(bool(ok.all()), "token_to_seq", lambda: f"token {int(np.argmin(ok))} is "
                  "not a row of the request token_to_seq names (cu_seq_lens)")
        starts = _host_ints(a["seq_starts"]).astype(np.int64) if given else \
            np.zeros(reqs, np.int64)
        c.require(bool((starts >= 0).all() and (starts % bs == 0).all()), "seq_starts",
                  lambda: f"seq_starts must be >= 0 and multiples of block_size = {bs}")
        table = _host_ints(a["block_table"])
        for r in sorted(set(seqs.tolist())):
            last = min(int(cu[r + 1]), n)
            _mla_used_blocks(c, table, r, int(starts[r]), int(starts[r]) + last - int(cu[r]),
                             nb, bs)
    values = dict(dst=dst, src_cache=a["src_cache"], block_table=a["block_table"],
                  cu_seq_lens=a["cu_seq_lens"], token_to_seq=t2s, num_tokens=n,
                  num_reqs=reqs, num_blocks=nb, block_size=bs, max_blocks=mb)
    if given:
        values["seq_starts"] = a["seq_starts"]
    return mla_gather_grid(n), (mla_gather_threads(), 1, 1), 0, values


def _mla_partials(c: Checker, a: dict, names: tuple[str, str, str], B: int, H: int) -> int:
    """m, l [B][Hq][kv_splits] and acc [B][Hq][kv_splits][MLA_LATENT] f32; kv_splits."""
    m, l_, acc = names
    c.array(m, a[m], np.float32, 3)
    S = int(a[m].shape[2])
    c.shape(m, a[m], (B, H, S))
    c.require(S >= 1, "shape", lambda: f"{m} has no split")
    c.array(l_, a[l_], np.float32, 3)
    c.shape(l_, a[l_], (B, H, S))
    c.array(acc, a[acc], np.float32, 4)
    c.shape(acc, a[acc], (B, H, S, MLA_LATENT))
    return S


def _mla_lens(c: Checker, a: dict, B: int) -> None:
    _index(c, a, "seq_lens", (B,))
    if a.get("validate_pos", True):
        lens = _host_ints(a["seq_lens"])
        c.require(bool((lens >= 1).all()), "seq_lens", lambda: f"seq_lens must be >= 1, "
                  f"got {lens.min()}")


def _mla_decode(k: Kernel, c: Checker, a: dict):
    q = a["query"]
    c.array("query", q, _elem(k.in_dtype), 3)
    B, H = (int(n) for n in q.shape[:2])
    c.shape("query", q, (B, H, MLA_ROW))
    c.require(B >= 1 and H >= 1, "shape", lambda: f"query has shape {tuple(q.shape)}")
    nb, bs = _latent_pages(k, c, "kv_cache", a["kv_cache"])
    _aligned(c, "kv_cache", a["kv_cache"])
    _, mb = _mla_tables(c, a, B)
    _mla_lens(c, a, B)
    if a.get("validate_pos", True):
        lens, table = _host_ints(a["seq_lens"]), _host_ints(a["block_table"])
        for r, n in enumerate(lens):
            _mla_used_blocks(c, table, r, 0, int(n), nb, bs)
    S = _mla_partials(c, a, ("m_out", "l_out", "acc_out"), B, H)
    _block_registers(k, c, MLA_THREADS, None)
    values = dict(query=q, kv_cache=a["kv_cache"], block_table=a["block_table"],
                  seq_lens=a["seq_lens"], m_out=a["m_out"], l_out=a["l_out"],
                  acc_out=a["acc_out"], n_head=H, kv_splits=S, num_blocks=nb, block_size=bs,
                  max_blocks=mb, scale=_param(c, a, "scale", 1.0 / math.sqrt(MLA_ROW)))
    return mla_decode_grid(H, S, B), (MLA_THREADS, 1, 1), 0, values


def _mla_combine(k: Kernel, c: Checker, a: dict):
    out = a["out"]
    c.array("out", out, _elem(k.out_dtype), 3)
    B, H = (int(n) for n in out.shape[:2])
    c.shape("out", out, (B, H, MLA_LATENT))
    c.require(B >= 1 and H >= 1, "shape", lambda: f"out has shape {tuple(out.shape)}")
    S = _mla_partials(c, a, ("m_in", "l_in", "acc_in"), B, H)
    _mla_lens(c, a, B)
    values = dict(m_in=a["m_in"], l_in=a["l_in"], acc_in=a["acc_in"], seq_lens=a["seq_lens"],
                  out=out, n_head=H, kv_splits=S)
    if k.lse is Lse.WRITE:
        c.array("lse", a["lse"], np.float32, 2)
        c.shape("lse", a["lse"], (B, H))
        values["lse"] = a["lse"]
    c.require(B * H <= INT_MAX, "int32 index", lambda: f"{B} requests x {H} heads overflow "
              "the kernel's int row index")
    return mla_combine_grid(B, H), (MLA_COMBINE_THREADS, 1, 1), 0, values


def _mla_prefill(k: Kernel, c: Checker, a: dict):
    q = a["query"]
    fi = _elem(k.in_dtype)
    c.array("query", q, fi, 3)
    Tq, H = (int(n) for n in q.shape[:2])
    c.shape("query", q, (Tq, H, MLA_PREFILL_QK))
    key, value = a["key"], a["value"]
    c.array("key", key, fi, 3)
    Tk = int(key.shape[0])
    c.shape("key", key, (Tk, H, MLA_PREFILL_QK))
    c.array("value", value, fi, 3)
    c.shape("value", value, (Tk, H, MLA_PREFILL_V))
    c.require(Tq >= 1 and H >= 1, "shape", lambda: f"query has shape {tuple(q.shape)}")
    for name, x in (("query", q), ("key", key), ("value", value)):
        _aligned(c, name, x)
    cu_q = a["cu_seqlens_q"]
    c.array("cu_seqlens_q", cu_q, np.int32, 1)
    reqs = int(cu_q.shape[0]) - 1
    c.require(reqs >= 1, "shape", "cu_seqlens_q needs num_reqs + 1 entries")
    _index(c, a, "cu_seqlens_k", (reqs + 1,))
    c.array("out", a["out"], _elem(k.out_dtype), 3)
    c.shape("out", a["out"], (Tq, H, MLA_PREFILL_V))
    values = dict(query=q, key=key, value=value, cu_seqlens_q=cu_q,
                  cu_seqlens_k=a["cu_seqlens_k"], out=a["out"], n_head=H, num_reqs=reqs,
                  total_q=Tq, scale=_param(c, a, "scale", 1.0 / math.sqrt(MLA_PREFILL_QK)))
    if k.lse is Lse.WRITE:
        c.array("lse", a["lse"], np.float32, 2)
        c.require(tuple(a["lse"].shape) == (H, Tq), "lse layout", lambda: f"lse has shape "
                  f"{tuple(a['lse'].shape)}; the LSE layout is [n_head][total_q] = {(H, Tq)}")
        values["lse"] = a["lse"]
    c.require(H * max(Tq, Tk) <= INT_MAX, "int32 index", lambda: f"{max(Tq, Tk)} rows x {H} "
              "heads overflow the kernel's int row index")
    mq = c.integer("max_seqlen_q", a["max_seqlen_q"], 1, Tq, "max_seqlen_q")
    if a.get("validate_pos", True):
        for name, total in (("cu_seqlens_q", Tq), ("cu_seqlens_k", Tk)):
            cu = _host_ints(a[name]).astype(np.int64)
            c.require(int(cu[0]) == 0 and int(cu[-1]) <= total and
                      bool((np.diff(cu) >= 0).all()), name,
                      lambda name=name, total=total: f"{name} must rise from 0 to at most "
                      f"the {total} rows")
        lens = np.diff(_host_ints(cu_q).astype(np.int64))
        c.require(int(lens.max()) <= mq, "max_seqlen_q", lambda: f"a request has "
                  f"{int(lens.max())} query rows, above max_seqlen_q = {mq}")
    _block_registers(k, c, MLA_PREFILL_ROWS * TARGET.warp, None)
    return mla_prefill_grid(mq, H, reqs), (MLA_PREFILL_ROWS * TARGET.warp, 1, 1), 0, values
