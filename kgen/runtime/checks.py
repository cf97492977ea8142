"""The launch contracts several ops' binders share (kgen.ops: ``OpDef.bind``).

An op object's binder imports what it needs from here: the cache and page arrays,
device positions, split partials, the optional scalars, the MLA latent pages and
index tensors. Nothing here asks an op object, so the op modules may import it
(kgen.runtime.bind, which does, dispatches to them).
"""

from __future__ import annotations

import math

import numpy as np

from kgen.ir.geometry import MLA_LATENT, MLA_ROW
from kgen.ir.kernel import Kernel
from kgen.ir.params import INT_MAX, PARAMS
from kgen.ir.target import TARGET
from kgen.runtime.contracts import Checker
from kgen.runtime.record import registers

QZ_BLOCK = 256  # threads per block of the 1-D qz_split launch
REGISTERS = "block registers"  # the contract a block too large for its registers breaks


def check_head_dim(k: Kernel, c: Checker, hd: int, rows: bool) -> None:
    """A block is head_dim threads; ``rows``: head_dim also lays out cache rows."""
    c.require(TARGET.fits_block(hd), "block size",
              lambda: f"head_dim = {hd}: a block is head_dim threads, at most {TARGET.max_threads}")
    if rows:
        fmt = k.pair  # both roles' rows
        c.require(fmt.accepts_head_dim(hd), "row format",
                  lambda: f"head_dim = {hd} must be a multiple of {fmt.block} (whole {fmt.name} "
                  "blocks)")


def cache_arrays(k: Kernel, c: Checker, a: dict, lead: tuple[int, ...], hd: int) -> int:
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


def cache_values(k: Kernel, c: Checker, a: dict, values: dict) -> None:
    """The cache arguments, the shadows and their row counts (sink rows, window ring)."""
    values.update(k_cache=a["k_cache"], v_cache=a["v_cache"])
    values.update({s.name: a[s.name] for s in k.pair.shadow_buffers()})
    if k.pair.shadows:
        values["sink"] = c.integer("sink", a.get("sink", 0), 0, k.sink_rows, "sink rows")
        values["win"] = c.integer("win", a.get("win", 0), 0, k.ring_rows, "window ring")
    for name in k.pair.scale_scalars():  # per-tensor scales: rows hold x / scale
        values[name] = param(c, a, name)


def block_registers(k: Kernel, c: Checker, threads: int, hd: int | None) -> None:
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


def device_positions(k: Kernel, c: Checker, a: dict, count: int, max_seq: int, rows: int,
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


PARTIALS_OUT = ("m_out", "l_out", "acc_out")  # a split kernel's partials
PARTIALS_IN = ("m_in", "l_in", "acc_in")      # the combine's


def partials(c: Checker, a: dict, names: tuple[str, str, str], heads: int, width: int,
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


def param(c: Checker, a: dict, name: str, unset: float | None = None):
    """A parameter the caller may leave out (kgen.ir.params): its default when it is
    not given (``unset`` where the default is None), checked in its range."""
    p = PARAMS[name]
    v = a.get(name, p.default)
    if p.kind is int:
        return c.integer(name, v, p.lo, p.hi)
    return _float32(c, name, v, unset if p.default is None else p.default, p.positive,
                    p.lo)


def learned_sinks(c: Checker, a: dict, heads: int):
    """One learned sink logit per q head (float32; -inf is no sink)."""
    s = a["sinks"]
    c.array("sinks", s, np.float32, 1)
    c.shape("sinks", s, (heads,))
    return s


def elem(dtype) -> np.dtype:
    """The NumPy dtype of an op's in_dtype / out_dtype arrays (the format's elements)."""
    return np.dtype(dtype.fmt.dtype)


def check_dflash_shape(k: Kernel, c: Checker, hd: int) -> None:
    """A lane holds dflash_chunks(k) dims of a row: head_dim within max_head_dim."""
    c.require(1 <= hd <= k.max_head_dim, "head_dim range",
              lambda: f"head_dim = {hd}: a warp holds rows of 1..max_head_dim = "
              f"{k.max_head_dim} dims")


def check_mla_shape(k: Kernel, c: Checker, hd: int, want: int) -> None:
    """One latent row width ``want`` (its op's ``mla_width``), fixed at compile time."""
    c.require(hd == want, "shape", lambda: f"head_dim = {hd}: {k.op.value} "
              f"serves rows of {want} only")


# ---- paged caches (position = paged) --------------------------------------------------
# Pages are [num_blocks][block_size][n_head_kv][row]; a request's block-table row maps
# its logical blocks to physical ones. The host passes shapes and upper bounds only:
# with validate_pos (the default) it also reads the index tensors back and checks
# them; a graph-captured launch passes validate_pos=False and owns their values.


def pages(k: Kernel, c: Checker, a: dict, hd: int) -> tuple[int, int, int]:
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


def index(c: Checker, a: dict, name: str, shape: tuple[int, ...]) -> object:
    c.array(name, a[name], np.int32, len(shape))
    c.shape(name, a[name], shape)
    return a[name]


def host_ints(x) -> np.ndarray:
    return np.asarray(x.get() if hasattr(x, "get") else x)


def slots_within(c: Checker, sm, positions: int) -> None:
    """A store's slot_mapping, read back: every slot below ``positions`` (negative ones
    skip), no two tokens on one slot."""
    slots = host_ints(sm)
    c.require(bool((slots < positions).all()), "slot_mapping", lambda: f"a slot beyond the "
              f"{positions} positions of the pages")
    live = slots[slots >= 0]
    c.require(len(set(live.tolist())) == live.size, "slot_mapping",
              "two tokens map to one slot (two blocks would race for it)")


# ---- multi-head latent attention --------------------------------------------------------
# The latent cache is pages [num_blocks][block_size][MLA_ROW] of the kernel's in_dtype
# (its kv_c / k_pe rows, queries and prefill q, K, V alike; outputs of out_dtype; the
# partials and every LSE f32), one KV head, V the
# first MLA_LATENT columns of each row. The index tensors are device tensors the kernels
# read in place; with validate_pos (the default) the host reads them back and checks
# them, a graph-captured launch passes validate_pos=False and owns their values (the
# kernels skip a slot, table entry or token that points outside the arrays).


def latent_pages(k: Kernel, c: Checker, name: str, x) -> tuple[int, int]:
    """The paged latent cache [num_blocks][block_size][MLA_ROW] of in_dtype; (num_blocks,
    block_size)."""
    c.array(name, x, elem(k.in_dtype), 3)
    nb, bs = (int(n) for n in x.shape[:2])
    c.shape(name, x, (nb, bs, MLA_ROW))
    c.require(nb >= 1 and bs >= 1, "shape", "empty paged cache")
    c.require(nb * bs <= INT_MAX, "int32 position", lambda: f"{nb} blocks of {bs} positions "
              "overflow an int position")
    return nb, bs


def mla_tables(c: Checker, a: dict, reqs: int | None) -> tuple[int, int]:
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


def mla_used_blocks(c: Checker, table: np.ndarray, r: int, first: int, last: int,
                    nb: int, bs: int) -> None:
    """Request ``r`` reads rows [first, last): its table maps each of their blocks."""
    mb = table.shape[1]
    c.require(last <= mb * bs, "block_table", lambda: f"request {r} reads row {last - 1}, "
              f"past its table's {mb} blocks of {bs}")
    used = table[r, first // bs: -(-last // bs)]
    c.require(bool(((used >= 0) & (used < nb)).all()), "block_table",
              lambda: f"request {r} maps a block outside [0, {nb})")


def mla_partials(c: Checker, a: dict, names: tuple[str, str, str], B: int, H: int) -> int:
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


def mla_lens(c: Checker, a: dict, B: int) -> None:
    index(c, a, "seq_lens", (B,))
    if a.get("validate_pos", True):
        lens = host_ints(a["seq_lens"])
        c.require(bool((lens >= 1).all()), "seq_lens", lambda: f"seq_lens must be >= 1, "
                  f"got {lens.min()}")
