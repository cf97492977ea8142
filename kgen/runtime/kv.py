"""KV-cache objects: append, prefill and decode over the generated kernels, for
any KV format and any generated variant.

This is the layer a host engine would otherwise write by hand: it owns the
cache buffers (laid out by the format object: body rows, and fp16 sink and
window shadows where the format keeps them; one ring per slot), computes the
decode split plan on the host, keeps scratch for the partials, runs decode as
split kernel + combine, and splits long appends and prefills so an fp16 window
ring is never lapped inside one launch. Kernels are chosen by their axes
(``kgen.runtime.select``), or named with ``variants={"prefill": name, ...}``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from math import copysign

import numpy as np

from kgen.formats import FORMATS
from kgen.ir.axes import KEYS, Mode, Op, Position
from kgen.runtime import launch as launching
from kgen.runtime import tuned as tune
from kgen.runtime.bind import INT_MAX
from kgen.runtime.contracts import ContractError
from kgen.runtime.plan import decode_plan
from kgen.runtime.select import Role, find

DEFAULT_KV = KEYS["kv"].default.value  # the spec's default format

# What each role of a cache object needs a kernel for (kv is filled in per cache).
ROLES = {
    "append": Role(Op.KV_APPEND),
    "append_dev": Role(Op.KV_APPEND, Position.DEVICE),
    "append_slots": Role(Op.KV_APPEND, Position.SLOTS),
    "prefill": Role(Op.FLASH, Position.HOST, Mode.PREFILL),
    "decode": Role(Op.FLASH, Position.HOST, Mode.DECODE),
    "decode_dev": Role(Op.FLASH, Position.DEVICE, Mode.DECODE),
    "decode_slots": Role(Op.FLASH, Position.SLOTS, Mode.DECODE),
    "combine": Role(Op.DECODE_COMBINE, Position.HOST),
    "combine_dev": Role(Op.DECODE_COMBINE, Position.DEVICE),
    "append_paged": Role(Op.KV_APPEND, Position.PAGED),
    "prefill_paged": Role(Op.FLASH, Position.PAGED, Mode.PREFILL),
    "decode_paged": Role(Op.FLASH, Position.PAGED, Mode.DECODE),
}


def _cp():
    import cupy

    return cupy


_F32 = np.dtype(np.float32)
STEPS_LIMIT = 64  # decode call signatures a cache remembers before it starts over
_DEFAULT_PLAN = (256, 16, "default")  # (kps, splits_cap, source) with none given or tuned


class _Step:
    """What one decode call signature derived (see KVCache.decode): the plan, or
    with none given the plan per tuned (kps, splits_cap, source)."""

    __slots__ = ("ndarray", "row", "groups", "tuned", "plan", "plans")

    def __init__(self, ndarray, row: tuple, groups: int, tuned: bool):
        self.ndarray, self.row, self.groups, self.tuned = ndarray, row, groups, tuned
        self.plan: _Plan | None = None
        self.plans: dict[tuple, _Plan] = {}


class _Plan:
    """One step's three launches (append, decode, combine) bound together, and the
    cache state they were derived from: the objects the cache held (buffers, shadow
    counts and scales: a replay needs the very same ones) and the kernel choice."""

    __slots__ = ("version", "last_plan", "k", "v", "shadows", "pos", "scratch", "sink", "win",
                 "k_scale", "v_scale", "replay", "empty", "out_shape")


def _function(fn, b):
    """The CuPy function a generated launcher ``fn`` launched ``b`` with, or None
    for anything but a generated launcher."""
    mod = sys.modules.get(getattr(fn, "__module__", None))
    k = getattr(mod, "KERNELS", {}).get(getattr(fn, "__name__", None))
    if k is None or k.name != b.kernel or getattr(mod, fn.__name__, None) is not fn:
        return None
    path = getattr(mod, "FATBIN", None) or mod.PTX
    return launching.function(path, b.kernel, _cp().cuda.runtime.getDevice())


def _is_int(v) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def _count(name: str, v, lo: int = 0, who: str = "KVCache") -> int:
    """An integer the kernels receive as a C int, at least ``lo``."""
    if not _is_int(v) or not lo <= v <= INT_MAX:
        raise ContractError(who, "range", f"{name} must be an integer in [{lo}, {INT_MAX}], "
                            f"not {v!r}")
    return int(v)


def _positive(name: str, v, who: str = "KVCache") -> int:
    return _count(name, v, 1, who)


class _Scratch:
    """Partials buffers, grown on demand: m, l [heads*width], acc [heads*width*hd]."""

    def __init__(self):
        self.m = self.l = self.acc = None

    def get(self, heads: int, width: int, hd: int):
        cp = _cp()
        need = heads * width
        if self.m is None or self.m.size < need:
            self.m = cp.empty(need, cp.float32)
            self.l = cp.empty(need, cp.float32)
            self.acc = cp.empty(need * hd, cp.float32)
        return self.m[:need], self.l[:need], self.acc[: need * hd]


class _Kernels:
    """The kernels one cache uses, chosen per role on first use and cached. Every
    kernel must lay the cache out alike: the same shadow rows as the append kernel,
    and a device combine planning with the device decode's tile."""

    def __init__(self, kv: str, head_dim: int, variants: dict[str, str] | None,
                 layout_role: str = "append"):
        self.kv, self.head_dim = kv, head_dim
        self.variants = dict(variants or {})
        unknown = set(self.variants) - set(ROLES)
        if unknown:
            raise ContractError("KVCache", "variant", f"unknown role(s) {sorted(unknown)}; "
                                f"roles are {sorted(ROLES)}")
        self._chosen: dict[tuple[str, int, int | None], tuple] = {}
        self._pinned: set[tuple[str, int, int | None]] = set()
        self.version = 0  # bumped when a choice already made changes (prefer)
        self.layout = self.get(layout_role)[0]  # fixes ring_rows / sink_rows

    def _same_layout(self, k) -> bool:
        if not FORMATS[self.kv].shadows or not hasattr(self, "layout"):
            return True
        return (k.ring_rows, k.sink_rows) == (self.layout.ring_rows, self.layout.sink_rows)

    def prefer(self, role: str, kernel: str, groups: int) -> None:
        """Use ``kernel`` for ``role`` (and its device-position sibling for the
        device form) unless the caller named variants; ignored if it cannot serve."""
        if role in self.variants or (role, groups, None) in self._pinned:
            return
        from kgen.runtime.select import generated, sibling

        try:
            self._chosen[(role, groups, None)] = find(
                self._role(role), self.head_dim, groups, kernel, self._same_layout)
            sib = sibling(kernel, Position.DEVICE, generated())
            if sib is not None and "decode_dev" not in self.variants:
                self._chosen[("decode_dev", groups, None)] = find(
                    self._role("decode_dev"), self.head_dim, groups, sib, self._same_layout)
        except ContractError:
            pass
        self._pinned.add((role, groups, None))
        self.version += 1

    def _role(self, role: str, needs: tuple = ()) -> Role:
        base = ROLES[role]
        return Role(base.op, base.position, base.mode,
                    self.kv if base.op in (Op.FLASH, Op.KV_APPEND) else None, needs)

    def has(self, *roles: str, groups: int = 1, needs: dict | None = None) -> bool:
        """Whether every role can be served (the device combine at the decode's tile)."""
        try:
            tile = None
            for role in roles:
                k, _ = self.get(role, groups, tile if role.startswith("combine") else None,
                                (needs or {}).get(role, ()))
                if k.op is Op.FLASH:
                    tile = k.tile_keys
        except ContractError:
            return False
        return True

    def named(self, role: str, groups: int, kernel: str):
        """``kernel`` for ``role`` if it serves this cache (a tuned choice), else None."""
        key = ("named", role, groups, kernel)
        if key not in self._chosen:
            try:
                self._chosen[key] = find(self._role(role), self.head_dim, groups, kernel,
                                         self._same_layout)
            except ContractError:
                self._chosen[key] = None
        return self._chosen[key]

    def get(self, role: str, groups: int = 1, tile: int | None = None, needs: tuple = ()):
        """The kernel for ``role``; ``needs``: option axes it must have (e.g. an exact
        window), from what the call asked for."""
        key = (role, groups, tile, needs) if needs else (role, groups, tile)
        if key not in self._chosen:
            def where(k):
                return self._same_layout(k) and (tile is None or k.tile_keys == tile)
            self._chosen[key] = find(self._role(role, needs), self.head_dim, groups,
                                     self.variants.get(role), where)
        return self._chosen[key]


_NO_SINKS: dict[tuple[int, int], object] = {}


def _stage(pos_dev, pos: int, stream) -> None:
    """Write the decode position into device memory in stream order. A fill kernel,
    not a copy: a copy from pageable host memory waits for the stream to drain first,
    which would stall the host on the previous step's kernels every step."""
    if stream is None:
        pos_dev.fill(pos)
    else:
        with stream:
            pos_dev.fill(pos)


def _no_sinks(n_head: int):
    """A device array of -inf sink logits (one per q head), made once per device."""
    cp = _cp()
    key = (n_head, cp.cuda.runtime.getDevice())
    if key not in _NO_SINKS:
        _NO_SINKS[key] = cp.full(n_head, -np.inf, cp.float32)
    return _NO_SINKS[key]


def _finite32(name: str, v, positive: bool) -> float:
    """A float scalar as the kernels receive it: finite in float32, > 0 or >= 0."""
    ok = isinstance(v, int | float | np.number) and not isinstance(v, bool | np.bool_)
    if ok:
        with np.errstate(over="ignore"):
            f = float(np.float32(v))
        ok = math.isfinite(f) and (f > 0 if positive else f >= 0)
    if not ok:
        raise ContractError("KVCache", name, f"{name} must be finite in float32 and "
                            f"{'> 0' if positive else '>= 0'}, not {v!r}")
    return float(v)


@dataclass(frozen=True)
class Options:
    """The attention options of one call, checked; which option axes the kernels
    must have for them, and the launch arguments each kernel takes."""

    attn_sink: int = 0
    attn_win: int = 0
    scale: float | None = None
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    sinks: object = None
    causal: bool = True

    @classmethod
    def checked(cls, n_head, attn_sink, attn_win, scale, window, softcap, sinks, causal):
        attn_sink, attn_win = _count("attn_sink", attn_sink), _count("attn_win", attn_win)
        if scale is not None:
            scale = _finite32("scale", scale, positive=True)
        if window is not None:
            if not (isinstance(window, tuple | list) and len(window) == 2):
                raise ContractError("KVCache", "window", "window is (left, right), distances "
                                    f"from the query (FlashAttention's window_size), not "
                                    f"{window!r}")
            window = (_count("window left", window[0]), _count("window right", window[1]))
            if attn_win:
                raise ContractError("KVCache", "window", "give either window (key-exact) or "
                                    "attn_win (tile-granular), not both")
        softcap = _finite32("softcap", softcap, positive=False)
        if sinks is not None and (getattr(sinks, "dtype", None) != np.float32 or
                                  tuple(getattr(sinks, "shape", ())) != (n_head,)):
            raise ContractError("KVCache", "sinks", f"sinks must be float32 [{n_head}] (one "
                                f"logit per q head), not {getattr(sinks, 'dtype', sinks)!r} "
                                f"{tuple(getattr(sinks, 'shape', ()))}")
        return cls(attn_sink, attn_win, scale, window, softcap, sinks, bool(causal))

    def needs(self, role: str) -> tuple[tuple[str, str], ...]:
        """The option axes the kernel serving ``role`` must have."""
        out = []
        if role.startswith(("prefill", "decode")):  # *_dev, *_slots and *_paged too
            if self.window is not None:
                out.append(("window", "exact"))
            if self.softcap > 0:
                out.append(("softcap", "tanh"))
        if role.startswith("prefill") and not self.causal:
            out.append(("mask", "full"))
        if self.sinks is not None and role in ("prefill", "prefill_paged", "combine",
                                               "combine_dev"):
            out.append(("sinks", "learned"))
        return tuple(out)

    def kwargs(self, k, n_head: int = 0) -> dict:
        """The keyword arguments a flash kernel with ``k``'s axes takes (``n_head``: the
        q heads, for the neutral sinks of a kernel that has them)."""
        out = {"attn_sink": self.attn_sink, "scale": self.scale}
        if k.window.value == "exact":
            left, right = self.window or (INT_MAX, INT_MAX)
            out.update(win_left=left, win_right=right)
        else:
            out["attn_win"] = self.attn_win
        if k.softcap.value == "tanh":
            out["softcap"] = self.softcap
        if k.sinks.value == "learned" and k.op is Op.FLASH:
            # A kernel chosen for another option may carry sinks nobody asked for: -inf
            # sinks change no bit.
            out["sinks"] = self.sinks if self.sinks is not None else _no_sinks(n_head)
        return out

    def combine_arrays(self, k) -> tuple:
        return (self.sinks,) if k.sinks.value == "learned" else ()


class KVCache:
    """One sequence's cache on the GPU, in any registered KV format (``kv``).

    A shadowed format also keeps fp16 copies of the first ``sink`` positions
    and of the last ``win`` positions (a ring of the kernels' ``ring_rows``), which
    the attention kernels read instead of the body.
    """

    def __init__(self, n_head_kv: int, head_dim: int, max_seq: int, kv: str = DEFAULT_KV,
                 sink: int = 0, win: int = 0, variants: dict[str, str] | None = None,
                 prefill_kernel: str | None = None, buffers: tuple | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0):
        if kv not in FORMATS:
            raise ContractError("KVCache", "kv", f"kv must be one of {sorted(FORMATS)}, "
                                f"not {kv!r}")
        self.fmt = FORMATS[kv]
        self.kv = kv
        self.n_head_kv = _positive("n_head_kv", n_head_kv)
        self.head_dim = _positive("head_dim", head_dim)
        self.max_seq = _positive("max_seq", max_seq)
        if prefill_kernel is not None:
            variants = {**(variants or {}), "prefill": prefill_kernel}
        self.kernels = _Kernels(kv, head_dim, variants)
        lay = self.kernels.layout
        self.RING_ROWS, self.SINK_ROWS = (lay.ring_rows, lay.sink_rows) if self.fmt.shadows \
            else (0, 0)
        self.sink, self.win = self._shadow_counts(sink, win)
        if not self.fmt.tensor_scales and (k_scale, v_scale) != (1.0, 1.0):
            raise ContractError("KVCache", "scales", f"kv = {kv} has no per-tensor scales")
        self.k_scale = _finite32("k_scale", k_scale, positive=True)
        self.v_scale = _finite32("v_scale", v_scale, positive=True)
        self.length = 0  # positions [0, length) hold keys
        self.scratch = _Scratch()
        self._pos = None  # device copy of decode's position (the device-position path)
        self._steps: dict[tuple, _Step] = {}  # decode's call signatures seen (see decode)
        self.last_plan: tuple[int, int, str] | None = None  # (kps, cap, given/tuned/default)
        self.last_prefill: str | None = None  # the kernel the last prefill ran
        if buffers is not None:  # a view of arrays owned elsewhere (one slot's rings)
            self.k, self.v, *shadows = buffers
        else:
            self.k, self.v, *shadows = allocate(self.fmt, (n_head_kv,), max_seq, head_dim,
                                                self.RING_ROWS, self.SINK_ROWS)
        self.shadows = tuple(shadows)

    def _shadow_counts(self, sink, win) -> tuple[int, int]:
        for name, v in (("sink", sink), ("win", win)):
            if not _is_int(v) or v < 0:
                raise ContractError("KVCache", "range", f"{name} must be an integer >= 0, "
                                    f"not {v!r}")
        if not self.fmt.shadows and (sink or win):
            raise ContractError("KVCache", "shadows", f"kv = {self.kv} keeps no fp16 sink/"
                                "window shadows; sink and win must be 0")
        if sink > self.SINK_ROWS or win > self.RING_ROWS:
            raise ContractError("KVCache", "shadows", f"sink <= {self.SINK_ROWS} and win <= "
                                f"{self.RING_ROWS} (the kernels' shadow rows); got {sink}, {win}")
        return int(sink), int(win)

    @property
    def _shadow_args(self) -> dict:
        """The format's own scalar arguments: shadow rows in use, per-tensor scales."""
        out = {"sink": self.sink, "win": self.win} if self.fmt.shadows else {}
        if self.fmt.tensor_scales:
            out.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return out

    def max_prefill_chunk(self) -> int:
        """Rows one prefill batch may have so no row's window key is lapped.

        All rows of a batch are appended before any is read; the window ring laps
        at RING_ROWS, so row 0 (needing keys > pos0 - win) stays exact while the
        batch ends before pos0 - win + RING_ROWS.
        """
        if not self.fmt.shadows or self.win <= 0:
            return self.max_seq
        return self.RING_ROWS - self.win + 1

    def _check_rows(self, name: str, x, rows: int | None = None) -> None:
        want = (self.n_head_kv, self.head_dim)
        if getattr(x, "ndim", 0) != 3 or tuple(x.shape[1:]) != want or x.dtype != np.float32:
            raise ContractError("KVCache", "shape", f"{name} must be float32 [n][{want[0]}]"
                                f"[{want[1]}], not {getattr(x, 'dtype', type(x))} "
                                f"{tuple(getattr(x, 'shape', ()))}")
        if rows is not None and x.shape[0] != rows:
            raise ContractError("KVCache", "shape", f"{name} has {x.shape[0]} rows, not {rows}")

    def _check_span(self, pos0: int, n: int, name: str = "pos0") -> None:
        if not _is_int(pos0):
            raise ContractError("KVCache", "range", f"{name} must be an integer, not {pos0!r}")
        if pos0 < 0 or pos0 + n > self.max_seq:
            raise ContractError("KVCache", "range", f"positions [{pos0}, {pos0} + {n}) must "
                                f"lie in [0, max_seq = {self.max_seq})")

    def append(self, k_new, v_new, pos0: int, stream=None) -> None:
        """Append rows [pos0, pos0 + n). A batch longer than the fp16 ring is
        appended in ring-sized launches (in one launch, two blocks would race for a
        ring slot); launches on one stream run in order."""
        self._check_rows("k_new", k_new)
        self._check_rows("v_new", v_new, k_new.shape[0])
        n = k_new.shape[0]
        self._check_span(pos0, n)
        _, fn = self.kernels.get("append")
        step = self.RING_ROWS if self.fmt.shadows and self.win > 0 else max(n, 1)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            fn(k_new[lo:hi], v_new[lo:hi], self.k, self.v, *self.shadows, pos0=pos0 + lo,
               **self._shadow_args, stream=stream)
        self.length = max(self.length, pos0 + n)

    def _check_q(self, q, ndim: int, rows: int | None = None) -> None:
        """q is float32 [n][n_head][head_dim] (prefill) or [n_head][head_dim] (decode)."""
        lead = "[n]" if ndim == 3 else ""
        ok = (getattr(q, "ndim", 0) == ndim and getattr(q, "dtype", None) == np.float32
              and q.shape[-1] == self.head_dim and (rows is None or q.shape[0] == rows))
        if not ok:
            raise ContractError("KVCache", "shape", f"q must be float32 {lead}[n_head]"
                                f"[{self.head_dim}]" + (f" with {rows} rows" if rows else "")
                                + f", not {getattr(q, 'dtype', type(q).__name__)} "
                                f"{tuple(getattr(q, 'shape', ()))}")

    def _groups(self, q) -> int:
        n_head = int(q.shape[-2])
        if n_head < 1 or n_head % self.n_head_kv:
            raise ContractError("KVCache", "GQA", f"n_head = {n_head} is not a multiple of "
                                f"n_head_kv = {self.n_head_kv}")
        return n_head // self.n_head_kv

    def _options(self, n_head: int, attn_sink=0, attn_win=0, scale=None, window=None,
                 softcap=0.0, sinks=None, causal=True) -> Options:
        return Options.checked(n_head, attn_sink, attn_win, scale, window, softcap, sinks,
                               causal)

    def prefill(self, q, k_new, v_new, pos0: int, attn_sink: int = 0, attn_win: int = 0,
                scale: float | None = None, window: tuple[int, int] | None = None,
                softcap: float = 0.0, sinks=None, causal: bool = True, stream=None):
        """Append rows [pos0, pos0+n) and attend each query row; returns out.

        Options (each picks a kernel that has it): ``window`` = (left, right) key-exact
        (FlashAttention's window_size), ``softcap`` > 0, ``sinks`` (a float32 logit per
        q head), ``causal=False`` (every row sees all pos0 + n keys). ``attn_win`` is
        the reference kernels' tile-granular recent window. Everything is checked
        before the first row is written."""
        self._check_q(q, 3)
        n = q.shape[0]
        self._check_rows("k_new", k_new, n)
        self._check_rows("v_new", v_new, n)
        self._check_span(pos0, n)
        opts = self._options(q.shape[1], attn_sink, attn_win, scale, window, softcap, sinks,
                             causal)
        G = self._groups(q)
        needs = opts.needs("prefill")
        step = n if not causal else self.max_prefill_chunk()
        kp, fn = self._prefill_kernel(G, min(n, step), needs)
        if not causal and n > self.max_prefill_chunk():
            raise ContractError("KVCache", "non-causal batch", f"a non-causal prefill sees "
                                "every row of its batch, so it runs in one launch: at most "
                                f"{self.max_prefill_chunk()} rows with this window ring")
        cp = _cp()
        out = cp.empty(q.shape, cp.float32)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            self.append(k_new[lo:hi], v_new[lo:hi], pos0 + lo, stream=stream)
            fn(q[lo:hi], self.k, self.v, *self.shadows, out[lo:hi], pos0=pos0 + lo,
               **self._shadow_args, **opts.kwargs(kp, q.shape[1]), stream=stream)
        self.last_prefill = kp.name
        return out

    def _check_decode(self, q, k_new, v_new) -> int:
        self._check_q(q, 2)
        self._check_rows("k_new", k_new, 1)
        self._check_rows("v_new", v_new, 1)
        return self._groups(q)

    def decode(self, q, k_new, v_new, pos: int, kps: int | None = None,
               splits_cap: int | None = None, attn_sink: int = 0, attn_win: int = 0,
               scale: float | None = None, window: tuple[int, int] | None = None,
               softcap: float = 0.0, sinks=None, stream=None):
        """Append the token at ``pos``, then split decode + combine; returns [n_head, hd].
        Options as for prefill (``sinks`` join in the combine). Everything is checked
        on the host before the row is appended. Where the format has device-position
        kernels, the step runs through them with the position staged in device
        memory: every launch argument is then the same from step to step, so each
        launch replays a remembered binding (the host plan and the device plan are
        one formula: the results are bit-identical).

        With no plan given, a plan and variant tuned for this GPU (`kgen tune`) are
        used when one is stored for the shape class, else kps 256 and 16 splits.

        A step with the signature of an earlier one (q's shape, the options and the
        plan, each of the same type) reuses what that one derived: the checked
        options, the kernels, the scratch and the launch arguments; the arrays'
        types, shapes and dtypes and the position are compared every time."""
        key = None
        if sinks is None:
            try:
                key = (q.shape, kps, splits_cap, attn_sink, attn_win, scale, window, softcap,
                       copysign(1.0, softcap), type(kps), type(splits_cap), type(attn_sink),
                       type(attn_win), type(scale), type(softcap), type(window),
                       *(map(type, window) if type(window) is tuple else ()))
                step = self._steps.get(key)
            except (AttributeError, TypeError):
                key = step = None
            if step is not None and type(pos) is int:
                out = self._replay(step, q, k_new, v_new, pos, stream)
                if out is not None:
                    return out
        G = self._check_decode(q, k_new, v_new)
        self._check_span(pos, 1)
        opts = self._options(q.shape[0], attn_sink, attn_win, scale, window, softcap, sinks)
        source = "given"
        tuned = kps is None and splits_cap is None and not opts.needs("decode")
        if tuned:
            kps, splits_cap = self._tuned_plan(G, pos + 1)
            source = "default" if kps is None else "tuned"
        kps = _positive("kps", 256 if kps is None else kps)
        splits_cap = _positive("splits_cap", 16 if splits_cap is None else splits_cap)
        self.last_plan = (kps, splits_cap, source)
        needs = {r: opts.needs(r) for r in ("decode_dev", "combine_dev")}
        if self.kernels.has("decode_dev", "append_dev", "combine_dev", groups=G, needs=needs):
            cp = _cp()
            if self._pos is None:
                self._pos = cp.zeros(1, cp.int32)
            _stage(self._pos, pos, stream)
            version, calls = self.kernels.version, []
            out = self._device_step(q, k_new, v_new, self._pos, kps, splits_cap, opts, None,
                                    False, stream, calls)
            self.length = max(self.length, pos + 1)
            if key is not None:
                self._remember_step(key, q, k_new, v_new, G, tuned, self.last_plan, version,
                                    calls)
            return out
        return self._decode_host(q, k_new, v_new, pos, kps, splits_cap, G, opts, stream)

    def _replay(self, s: _Step, q, k_new, v_new, pos: int, stream):
        """A step like the one ``s`` remembers, or None where anything differs (the
        caller then checks and binds in full)."""
        nd = s.ndarray
        if not (0 <= pos < self.max_seq and q.__class__ is nd and k_new.__class__ is nd
                and v_new.__class__ is nd and q.dtype is _F32 and k_new.dtype is _F32
                and v_new.dtype is _F32 and k_new.shape == s.row and v_new.shape == s.row):
            return None
        if s.tuned:
            c = tune.tuned(self.kv, self.head_dim, s.groups, pos + 1)
            if c is None:
                p = s.plans.get(_DEFAULT_PLAN)
            elif type(c.kps) is int and type(c.splits_cap) is int:
                self.kernels.prefer("decode", c.kernel, s.groups)
                p = s.plans.get((c.kps, c.splits_cap, "tuned"))
            else:
                return None
        else:
            p = s.plan
        if (p is None or p.version != self.kernels.version or self.k is not p.k
                or self.v is not p.v or self.shadows is not p.shadows or self._pos is not p.pos
                or self.scratch.m is not p.scratch or self.sink is not p.sink
                or self.win is not p.win or self.k_scale is not p.k_scale
                or self.v_scale is not p.v_scale):
            return None
        out = p.empty(p.out_shape, _F32)
        arrays = p.replay.check((k_new, v_new, q, out))
        if arrays is None:
            return None
        self.last_plan = p.last_plan
        _stage(p.pos, pos, stream)
        p.replay.run(arrays, stream)
        if pos >= self.length:
            self.length = pos + 1
        return out

    def _remember_step(self, key: tuple, q, k_new, v_new, groups: int, tuned: bool,
                       last_plan: tuple, version: int, calls: list) -> None:
        """Keep what a device-position step derived, for the next step like it."""
        cp = _cp()
        nd = cp.ndarray
        if not (q.__class__ is nd and k_new.__class__ is nd and v_new.__class__ is nd
                and q.dtype is _F32 and k_new.dtype is _F32 and v_new.dtype is _F32):
            return
        fns = [_function(fn, b) for fn, b in calls]
        if None in fns or version != self.kernels.version:
            return
        bound = [(b, f) for (_, b), f in zip(calls, fns, strict=True)]
        swap = ((0, "k_new"), (0, "v_new"), (1, "q"), (2, "out"))  # append, decode, combine
        try:
            replay = launching.Replay(bound, swap, cp.cuda.runtime.getDevice())
        except (TypeError, ValueError):  # an argument not a cupy array, or not there
            return
        p = _Plan()
        p.version, p.last_plan, p.replay = version, last_plan, replay
        p.k, p.v, p.shadows, p.pos = self.k, self.v, self.shadows, self._pos
        p.scratch = self.scratch.m
        p.sink, p.win, p.k_scale, p.v_scale = self.sink, self.win, self.k_scale, self.v_scale
        p.empty, p.out_shape = cp.empty, (q.shape[0], self.head_dim)
        s = self._steps.get(key)
        if s is None or s.ndarray is not nd:
            if len(self._steps) >= STEPS_LIMIT:
                self._steps.clear()
            s = self._steps[key] = _Step(nd, (1, self.n_head_kv, self.head_dim), groups,
                                         tuned)
        if tuned:
            s.plans[last_plan] = p
        else:
            s.plan = p

    def _prefill_kernel(self, groups: int, rows: int, needs: tuple):
        """The prefill kernel for batches of ``rows``: a named variant, else the one
        `kgen tune` stored for the class (when no option is asked for), else the
        kernel ranked first."""
        if not needs and "prefill" not in self.kernels.variants:
            c = tune.tuned_prefill(self.kv, self.head_dim, groups, rows)
            if c is not None:
                hit = self.kernels.named("prefill", groups, c.kernel)
                if hit is not None:
                    return hit
        return self.kernels.get("prefill", groups, needs=needs)

    def _tuned_plan(self, groups: int, seq_len: int) -> tuple[int | None, int | None]:
        """(kps, splits_cap) stored by `kgen tune`, adopting its variant for decode
        (and the device-position sibling of that variant) unless variants were named."""
        c = tune.tuned(self.kv, self.head_dim, groups, seq_len)
        if c is None:
            return None, None
        self.kernels.prefer("decode", c.kernel, groups)
        return c.kps, c.splits_cap

    def _decode_host(self, q, k_new, v_new, pos, kps, splits_cap, G, opts, stream):
        """The host-plan form: split kernel over the live plan + combine."""
        cp = _cp()
        kdec, fdec = self.kernels.get("decode", G, needs=opts.needs("decode"))
        kc, fcomb = self.kernels.get("combine", needs=opts.needs("combine"))
        plan = decode_plan(pos + 1, kps, splits_cap, kdec.tile_keys)
        self.append(k_new, v_new, pos, stream=stream)
        n_head = q.shape[0]
        m, l, acc = self.scratch.get(n_head, plan.n_splits, self.head_dim)
        fdec(q, self.k, self.v, *self.shadows, m, l, acc, seq_len=plan.seq_len,
             n_splits=plan.n_splits, split_len=plan.split_len, **self._shadow_args,
             **opts.kwargs(kdec), stream=stream)
        out = cp.empty((n_head, self.head_dim), cp.float32)
        fcomb(m, l, acc, out, *opts.combine_arrays(kc), n_splits=plan.n_splits, stream=stream)
        return out

    def decode_device(self, q, k_new, v_new, pos_dev, kps: int = 256, splits_cap: int = 16,
                      attn_sink: int = 0, attn_win: int = 0, scale: float | None = None,
                      window: tuple[int, int] | None = None, softcap: float = 0.0,
                      sinks=None, out=None, validate_pos: bool = True, stream=None):
        """decode with the position in device memory (capturable in a CUDA graph):
        every launch argument and grid is position-invariant."""
        self._check_decode(q, k_new, v_new)
        opts = self._options(q.shape[0], attn_sink, attn_win, scale, window, softcap, sinks)
        kps, splits_cap = _positive("kps", kps), _positive("splits_cap", splits_cap)
        return self._device_step(q, k_new, v_new, pos_dev, kps, splits_cap, opts, out,
                                 validate_pos, stream)

    def _device_step(self, q, k_new, v_new, pos_dev, kps, splits_cap, opts, out,
                     validate_pos, stream, calls: list | None = None):
        """The three device-position launches; ``calls`` collects (launcher, Launch)
        of each."""
        cp = _cp()
        G = self._groups(q)
        kdec, fdec = self.kernels.get("decode_dev", G, needs=opts.needs("decode_dev"))
        _, fapp = self.kernels.get("append_dev")
        kc, fcomb = self.kernels.get("combine_dev", tile=kdec.tile_keys,
                                     needs=opts.needs("combine_dev"))
        n_head = q.shape[0]
        m, l, acc = self.scratch.get(n_head, splits_cap, self.head_dim)
        b_app = fapp(k_new, v_new, self.k, self.v, *self.shadows, pos_dev, **self._shadow_args,
                     validate_pos=validate_pos, stream=stream)
        b_dec = fdec(q, self.k, self.v, *self.shadows, m, l, acc, pos_dev, kps=kps,
                     splits_cap=splits_cap, **self._shadow_args, **opts.kwargs(kdec),
                     validate_pos=validate_pos, stream=stream)
        out = cp.empty((n_head, self.head_dim), cp.float32) if out is None else out
        b_comb = fcomb(m, l, acc, out, *opts.combine_arrays(kc), pos_dev, kps=kps,
                       splits_cap=splits_cap, validate_pos=validate_pos, stream=stream)
        if calls is not None:
            calls += [(fapp, b_app), (fdec, b_dec), (fcomb, b_comb)]
        return out


def allocate(fmt, lead: tuple[int, ...], max_seq: int, head_dim: int, ring_rows: int,
             sink_rows: int) -> list:
    """Zeroed body (K, V) and shadow arrays in ``fmt``'s layout, argument order."""
    cp = _cp()
    if not fmt.accepts_head_dim(head_dim):
        raise ContractError("KVCache", "row format", f"head_dim = {head_dim} is not whole "
                            f"{fmt.name} blocks of {fmt.block}")
    body = (*lead, max_seq, fmt.row_width(head_dim))
    rows = {"ring_rows": ring_rows, "sink_rows": sink_rows}
    return [cp.zeros(body, fmt.dtype), cp.zeros(body, fmt.dtype),
            *(cp.zeros((*lead, rows[s.rows_key], head_dim), cp.float16)
              for s in fmt.shadow_buffers())]


class SlotKVCache:
    """Independent users, one ring per slot, each decoding at its own position."""

    def __init__(self, nslots: int, n_head_kv: int, head_dim: int, max_seq: int,
                 kv: str = DEFAULT_KV, sink: int = 0, win: int = 0,
                 variants: dict[str, str] | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0):
        self.nslots = _positive("nslots", nslots)
        # Slot 0 as a plain cache validates every argument and fixes the layout.
        probe = KVCache(n_head_kv, head_dim, max_seq, kv, sink, win, variants,
                        buffers=(None, None), k_scale=k_scale, v_scale=v_scale)
        self.k_scale, self.v_scale = probe.k_scale, probe.v_scale
        self.kv, self.fmt, self.kernels = kv, probe.fmt, probe.kernels
        self.n_head_kv, self.head_dim, self.max_seq = n_head_kv, head_dim, max_seq
        self.sink, self.win = probe.sink, probe.win
        self.RING_ROWS, self.SINK_ROWS = probe.RING_ROWS, probe.SINK_ROWS
        self.variants = variants
        self.scratch = _Scratch()
        self.k, self.v, *shadows = allocate(self.fmt, (nslots, n_head_kv), max_seq, head_dim,
                                            self.RING_ROWS, self.SINK_ROWS)
        self.shadows = tuple(shadows)

    _shadow_args = KVCache._shadow_args

    def slot(self, u: int, prefill_kernel: str | None = None) -> KVCache:
        """Slot ``u``'s rings as a single-sequence KVCache (views, no copy): its
        slice of the per-slot layout is laid out exactly like one sequence's cache,
        so prefill (chunked) and append run on it unchanged."""
        if not _is_int(u) or not 0 <= u < self.nslots:
            raise IndexError(f"slot {u!r} of {self.nslots} (slots are 0..{self.nslots - 1})")
        bufs = (self.k[u], self.v[u], *(s[u] for s in self.shadows))
        return KVCache(self.n_head_kv, self.head_dim, self.max_seq, kv=self.kv, sink=self.sink,
                       win=self.win, variants=self.variants, prefill_kernel=prefill_kernel,
                       buffers=bufs, k_scale=self.k_scale, v_scale=self.v_scale)

    def prefill(self, u: int, q, k_new, v_new, pos0: int, **kw):
        """Prefill one user's prompt into its own ring; returns [n][n_head][head_dim]."""
        return self.slot(u).prefill(q, k_new, v_new, pos0, **kw)

    def _positions(self, pos) -> list[int]:
        """One integer position per slot, each in [0, max_seq)."""
        try:
            listed = list(pos.get() if hasattr(pos, "get") else pos)
        except TypeError:
            raise ContractError("SlotKVCache", "shape", f"pos must list one position per "
                                f"slot ({self.nslots}), not {pos!r}") from None
        if len(listed) != self.nslots:
            raise ContractError("SlotKVCache", "shape",
                                f"{len(listed)} positions for {self.nslots} slots")
        for u, p in enumerate(listed):
            if not _is_int(p):
                raise ContractError("SlotKVCache", "range", f"pos[{u}] = {p!r} is not an "
                                    "integer")
            if not 0 <= p < self.max_seq:
                raise ContractError("SlotKVCache", "range", f"pos[{u}] = {int(p)} (slot {u}) "
                                    f"is outside [0, max_seq = {self.max_seq})")
        return [int(p) for p in listed]

    def _check_slot_rows(self, name: str, x, n_head: int | None = None) -> None:
        """float32 [nslots][heads][head_dim]: q (n_head heads) or a new K/V row."""
        heads = self.n_head_kv if n_head is None else n_head
        shape = tuple(getattr(x, "shape", ()))
        ok = (getattr(x, "ndim", 0) == 3 and getattr(x, "dtype", None) == np.float32
              and shape[0] == self.nslots and shape[2] == self.head_dim
              and (n_head is not None or shape[1] == heads))
        if not ok:
            want = "n_head" if n_head is not None else str(heads)
            raise ContractError("SlotKVCache", "shape", f"{name} must be float32 [nslots = "
                                f"{self.nslots}][{want}][{self.head_dim}], not "
                                f"{getattr(x, 'dtype', type(x).__name__)} {shape}")

    def append(self, k_new, v_new, pos, stream=None) -> None:
        """Each slot's one new row at its own position (device or host int32 positions)."""
        self._check_slot_rows("k_new", k_new)
        self._check_slot_rows("v_new", v_new)
        on_device = type(pos).__module__.split(".")[0] == "cupy"  # checked by the launcher
        host = None if on_device else self._positions(pos)
        cp = _cp()
        if host is not None:
            pos = cp.asarray(host, dtype=cp.int32)
        _, fn = self.kernels.get("append_slots")
        fn(k_new, v_new, self.k, self.v, *self.shadows, pos, **self._shadow_args, stream=stream)

    def decode(self, q, k_new, v_new, pos, kps: int = 256, splits_cap: int = 16,
               attn_sink: int = 0, attn_win: int = 0, scale: float | None = None,
               window: tuple[int, int] | None = None, softcap: float = 0.0, stream=None):
        """Each slot appends its row at pos[slot] and attends its own ring.

        ``pos``: host ints (one per slot) or a device int32 array. Returns
        [nslots, n_head, head_dim]. Everything is checked before any row is written.
        """
        pos_host = self._positions(pos)
        self._check_slot_rows("q", q, n_head=0)
        self._check_slot_rows("k_new", k_new)
        self._check_slot_rows("v_new", v_new)
        n_head = q.shape[1]
        if n_head < 1 or n_head % self.n_head_kv:
            raise ContractError("SlotKVCache", "GQA", f"n_head = {n_head} is not a multiple "
                                f"of n_head_kv = {self.n_head_kv}")
        opts = Options.checked(n_head, attn_sink, attn_win, scale, window, softcap, None, True)
        kdec, fdec = self.kernels.get("decode_slots", n_head // self.n_head_kv,
                                      needs=opts.needs("decode_slots"))
        _, fcomb = self.kernels.get("combine")
        kps, splits_cap = _positive("kps", kps), _positive("splits_cap", splits_cap)
        cp = _cp()
        width = max(decode_plan(p + 1, kps, splits_cap, kdec.tile_keys).n_splits
                    for p in pos_host)
        pos_dev = cp.asarray(pos_host, dtype=cp.int32)
        self.append(k_new, v_new, pos_dev, stream=stream)
        heads = self.nslots * n_head
        m, l, acc = self.scratch.get(heads, width, self.head_dim)
        fdec(q, self.k, self.v, *self.shadows, m, l, acc, pos_dev, kps=kps,
             splits_cap=splits_cap, **self._shadow_args, **opts.kwargs(kdec), launch_splits=width,
             stream=stream)
        out = cp.empty((heads, self.head_dim), cp.float32)
        fcomb(m, l, acc, out, n_splits=width, stream=stream)
        return out.reshape(self.nslots, n_head, self.head_dim)
