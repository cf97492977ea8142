"""KV-cache objects: append, prefill and decode over the generated kernels, for
any KV format and any generated variant.

This is the layer a host engine would otherwise write by hand: it owns the
cache buffers (laid out by the format object: body rows, and fp16 sink and
window shadows where the format keeps them; one ring per slot), computes the
decode split plan on the host, keeps scratch for the partials, runs decode as
split kernel + combine, and splits long appends and prefills so an fp16 window
ring is never lapped inside one launch. Kernels are chosen by their axes
(``kgen.runtime.select``), or named with ``variants={"prefill": name, ...}``.

The cache objects are here; the rest of the layer is beside them: the kernel
choice per role (``kgen.runtime.roles``), a call's options checked and translated
into launch arguments (``kgen.runtime.options``), the decode steps a cache
remembers and replays (``kgen.runtime.replay``), and the choices `kgen tune`
stored (``kgen.runtime.tuned``).
"""

from __future__ import annotations

import math

import numpy as np

from kgen.formats import FORMATS, as_pair, pair
from kgen.ir.axes import KEYS
from kgen.ir.geometry import prefill_grid
from kgen.ir.params import INT_MAX
from kgen.runtime import device, replay
from kgen.runtime import tuned as store
from kgen.runtime.calls import Calls
from kgen.runtime.contracts import ContractError
from kgen.runtime.convention import public, read_back
from kgen.runtime.options import Options, count, given_plan, groups, is_int, positive, scales
from kgen.runtime.pending import Pending, empty, upload
from kgen.runtime.plan import decode_plan
from kgen.runtime.planner import kernel_plan, split_plan
from kgen.runtime.replay import STEPS_LIMIT
from kgen.runtime.roles import ROLES, CacheKernels

__all__ = ["DEFAULT_KV", "INT_MAX", "ROLES", "STEPS_LIMIT", "KVCache", "Options", "SlotKVCache",
           "allocate"]

DEFAULT_KV = KEYS["kv"].default.value  # the spec's default format


class Scratch:
    """Partials buffers, grown on demand: m, l [heads*width], acc [heads*width*hd]."""

    def __init__(self):
        self.m = self.l = self.acc = None

    def get(self, heads: int, width: int, hd: int):
        cp = device.cupy()
        need = heads * width
        if self.m is None or self.m.size < need:
            self.m = cp.empty(need, cp.float32)
            self.l = cp.empty(need, cp.float32)
            self.acc = cp.empty(need * hd, cp.float32)
        return self.m[:need], self.l[:need], self.acc[: need * hd]

    def pending(self, heads: int, width: int, hd: int) -> tuple[Pending, Pending, Pending]:
        """What ``get`` returns, got once the call is checked."""
        need, got = heads * width, []

        def part(i: int):
            if not got:
                got.extend(self.get(heads, width, hd))
            return got[i]
        return tuple(Pending((n,), np.float32, lambda i=i: part(i))
                     for i, n in enumerate((need, need, need * hd)))


def attend_calls(calls: Calls, kernels: CacheKernels, scratch: Scratch, kp, fn, inputs: tuple,
                 out, blocks: int, groups: int, kw: dict) -> tuple:
    """Add the launches of a prefill with the whole kernel ``kp`` (launcher ``fn``) over
    ``inputs`` (q and the cache arrays, the arrays before its output) into ``out``
    [rows][n_head][head_dim], ``blocks`` blocks of ``groups`` q heads per kv head: ``kp``
    itself, or, where its query tiles leave the device's SMs idle
    (kgen.runtime.plan.prefill_splits) and it has a split twin, the twin over that many
    key splits into ``scratch`` and the combine into ``out``. Returns (the kernel that
    attends, its splits)."""
    rows, n_head, hd = (int(x) for x in out.shape)
    split = kernels.split(kp)
    splits = 1 if split is None else split_plan(split[0][0], hd, groups, blocks)
    if splits == 1:
        calls.add(fn, *inputs, out, **kw)
        return kp, 1
    (ks, fs), (_, fc) = split
    m, l, acc = scratch.pending(rows * n_head, splits, hd)
    calls.add(fs, *inputs, m, l, acc, n_splits=splits, **kw)
    calls.add(fc, m, l, acc, out.reshape(rows * n_head, hd), n_splits=splits)
    return ks, splits


def cache_formats(who: str, kv, v_kv):
    """The pair of a cache's K rows ``kv`` and V rows ``v_kv`` (None: kv's), both
    registered format names."""
    for key, name in (("kv", kv), ("v_kv", v_kv)):
        if name is None and key == "v_kv":
            continue
        if not isinstance(name, str) or name not in FORMATS:
            raise ContractError(who, key, f"{key} must be one of {sorted(FORMATS)}, "
                                f"not {name!r}")
    return pair(kv, v_kv)


class KVCache:
    """One sequence's cache on the GPU, in any registered KV format (``kv``), or K rows
    in ``kv`` and V rows in another format ``v_kv`` (a mixed cache, where kernels of
    that pair are generated: specs/mixed.kspec).

    A shadowed format also keeps fp16 copies of the first ``sink`` positions
    and of the last ``win`` positions (a ring of the kernels' ``ring_rows``), which
    the attention kernels read instead of the body (in a mixed cache, of the roles
    whose format keeps them).
    """

    def __init__(self, n_head_kv: int, head_dim: int, max_seq: int, kv: str = DEFAULT_KV,
                 sink: int = 0, win: int = 0, variants: dict[str, str] | None = None,
                 prefill_kernel: str | None = None, buffers: tuple | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0, v_kv: str | None = None):
        self.pair = cache_formats("KVCache", kv, v_kv)
        self.fmt = self.pair.k  # the K rows' format (both roles' unless mixed)
        self.kv, self.v_kv = kv, self.pair.v.name
        self.n_head_kv = positive("n_head_kv", n_head_kv)
        self.head_dim = positive("head_dim", head_dim)
        self.max_seq = positive("max_seq", max_seq)
        if prefill_kernel is not None:
            variants = {**(variants or {}), "prefill": prefill_kernel}
        self.kernels = CacheKernels(kv, head_dim, variants, v_kv=self.v_kv)
        lay = self.kernels.layout
        self.RING_ROWS, self.SINK_ROWS = (lay.ring_rows, lay.sink_rows) if self.pair.shadows \
            else (0, 0)
        self.sink, self.win = self._shadow_counts(sink, win)
        self.k_scale, self.v_scale = scales(self.pair, k_scale, v_scale)
        self.length = 0  # positions [0, length) hold keys
        self.scratch = Scratch()
        self.prefill_scratch = Scratch()  # a split prefill's partials
        self._pos = None  # device copy of decode's position (the device-position path)
        self._steps: dict[tuple, replay.Step] = {}  # decode's call signatures seen (see decode)
        # (kps, cap, given/tuned/default); (0, 0, "prefill") where the step ran as a
        # one-row prefill (_decode_by_prefill)
        self.last_plan: tuple[int, int, str] | None = None
        self._default_plans: dict[tuple, tuple[int, int]] = {}  # see plan()
        self.last_prefill: str | None = None  # the prefill kernel the last prefill chose
        self.last_prefill_split: str | None = None  # its split twin, where that ran
        self.last_prefill_splits = 1  # the key splits it ran (the whole kernel: 1)
        if buffers is not None:  # a view of arrays owned elsewhere (one slot's rings)
            self.k, self.v, *shadows = buffers
        else:
            self.k, self.v, *shadows = allocate(self.pair, (n_head_kv,), max_seq, head_dim,
                                                self.RING_ROWS, self.SINK_ROWS)
        self.shadows = tuple(shadows)

    def _shadow_counts(self, sink, win) -> tuple[int, int]:
        for name, v in (("sink", sink), ("win", win)):
            if not is_int(v) or v < 0:
                raise ContractError("KVCache", "range", f"{name} must be an integer >= 0, "
                                    f"not {v!r}")
        if not self.pair.shadows and (sink or win):
            raise ContractError("KVCache", "shadows", f"kv = {self.pair.name} keeps no fp16 "
                                "sink/window shadows; sink and win must be 0")
        if sink > self.SINK_ROWS or win > self.RING_ROWS:
            raise ContractError("KVCache", "shadows", f"sink <= {self.SINK_ROWS} and win <= "
                                f"{self.RING_ROWS} (the kernels' shadow rows); got {sink}, {win}")
        return int(sink), int(win)

    @property
    def _shadow_args(self) -> dict:
        """The format's own scalar arguments: shadow rows in use, per-tensor scales."""
        out = {"sink": self.sink, "win": self.win} if self.pair.shadows else {}
        scale = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        out.update({name: scale[name] for name in self.pair.scale_scalars()})
        return out

    def max_prefill_chunk(self) -> int:
        """Rows one prefill batch may have so no row's window key is lapped.

        All rows of a batch are appended before any is read; the window ring laps
        at RING_ROWS, so row 0 (needing keys > pos0 - win) stays exact while the
        batch ends before pos0 - win + RING_ROWS.
        """
        if not self.pair.shadows or self.win <= 0:
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
        if not is_int(pos0):
            raise ContractError("KVCache", "range", f"{name} must be an integer, not {pos0!r}")
        if pos0 < 0 or pos0 + n > self.max_seq:
            raise ContractError("KVCache", "range", f"positions [{pos0}, {pos0} + {n}) must "
                                f"lie in [0, max_seq = {self.max_seq})")

    @public("KVCache.append", widen_args=("k_new", "v_new"))
    def append(self, k_new, v_new, pos0: int, stream=None) -> None:
        """Append rows [pos0, pos0 + n). A batch longer than the fp16 ring is
        appended in ring-sized launches (in one launch, two blocks would race for a
        ring slot); launches on one stream run in order. Every launch is checked
        before the first runs."""
        calls = Calls()
        n = self._append_calls(calls, k_new, v_new, pos0)
        calls.run(stream)
        self.length = max(self.length, pos0 + n)

    def _append_calls(self, calls: Calls, k_new, v_new, pos0: int) -> int:
        """The launches appending rows [pos0, pos0 + n); returns n."""
        self._check_rows("k_new", k_new)
        self._check_rows("v_new", v_new, k_new.shape[0])
        n = k_new.shape[0]
        self._check_span(pos0, n)
        _, fn = self.kernels.get("append")
        step = self.RING_ROWS if self.pair.shadows and self.win > 0 else max(n, 1)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            calls.add(fn, k_new[lo:hi], v_new[lo:hi], self.k, self.v, *self.shadows,
                      pos0=pos0 + lo, **self._shadow_args)
        return n

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
        return groups(int(q.shape[-2]), self.n_head_kv)

    def _options(self, n_head: int, attn_sink=0, attn_win=0, scale=None, window_size=None,
                 softcap=0.0, sinks=None, causal=True) -> Options:
        return Options.checked(n_head, attn_sink, attn_win, scale, window_size, softcap, sinks,
                               causal)

    @public("KVCache.prefill", widen_args=("q", "k_new", "v_new"), arrays=("sinks",),
            out_like="q")
    def prefill(self, q, k_new, v_new, pos0: int, attn_sink: int = 0, attn_win: int = 0,
                scale: float | None = None, window_size: tuple[int, int] | None = None,
                softcap: float = 0.0, sinks=None, causal: bool = True, stream=None):
        """Append rows [pos0, pos0+n) and attend each query row; returns out.

        Options (each picks a kernel that has it): ``window_size`` = (left, right)
        key-exact, FlashAttention's (-1: no bound on that side), ``softcap`` > 0,
        ``sinks`` (a float32 logit per q head), ``causal=False`` (every row sees all
        pos0 + n keys). ``attn_win`` is the reference kernels' tile-granular recent
        window. Everything is checked
        (every launch against its kernel's contracts) before the first row is
        written."""
        self._check_q(q, 3)
        n = q.shape[0]
        self._check_rows("k_new", k_new, n)
        self._check_rows("v_new", v_new, n)
        self._check_span(pos0, n)
        opts = self._options(q.shape[1], attn_sink, attn_win, scale, window_size, softcap, sinks,
                             causal)
        G = self._groups(q)
        needs = opts.needs("prefill")
        step = max(n if not opts.causal else self.max_prefill_chunk(), 1)
        kp, fn = self._prefill_kernel(G, min(n, step), needs)
        if not opts.causal and n > self.max_prefill_chunk():
            raise ContractError("KVCache", "non-causal batch", f"a non-causal prefill sees "
                                "every row of its batch, so it runs in one launch: at most "
                                f"{self.max_prefill_chunk()} rows with this window ring")
        calls, out = Calls(), empty(q.shape)
        ran = (kp, 1)  # (the kernel, its splits) of the last chunk; no rows: no launch
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            self._append_calls(calls, k_new[lo:hi], v_new[lo:hi], pos0 + lo)
            ran = self._attend(calls, q[lo:hi], out[lo:hi], pos0 + lo, kp, fn, opts)
        calls.run(stream)
        self.length = max(self.length, pos0 + n)
        self.last_prefill = kp.name
        self.last_prefill_split = ran[0].name if ran[1] > 1 else None
        self.last_prefill_splits = ran[1]
        return out.made()

    def _attend(self, calls: Calls, q, out, pos0: int, kp, fn, opts: Options) -> tuple:
        """Add the launches that attend q's rows at positions pos0.. into ``out`` with the
        prefill ``kp`` (attend_calls). Returns (the kernel, its splits)."""
        n, n_head, hd = (int(x) for x in q.shape)
        G = n_head // self.n_head_kv
        return attend_calls(calls, self.kernels, self.prefill_scratch, kp, fn,
                            (q, self.k, self.v, *self.shadows), out,
                            math.prod(prefill_grid(kp, n, G, self.n_head_kv)), G,
                            dict(pos0=pos0, **self._shadow_args, **opts.kwargs(kp, n_head)))

    def _check_decode(self, q, k_new, v_new) -> int:
        self._check_q(q, 2)
        self._check_rows("k_new", k_new, 1)
        self._check_rows("v_new", v_new, 1)
        return self._groups(q)

    @public("KVCache.decode", widen_args=("q", "k_new", "v_new"), arrays=("sinks",),
            out_like="q")
    def decode(self, q, k_new, v_new, pos: int, kps: int | None = None,
               splits_cap: int | None = None, attn_sink: int = 0, attn_win: int = 0,
               scale: float | None = None, window_size: tuple[int, int] | None = None,
               softcap: float = 0.0, sinks=None, stream=None):
        """Append the token at ``pos``, then split decode + combine; returns [n_head, hd]
        (q [n_head, hd]), or [1, n_head, hd] for a token-major q [1, n_head, hd].
        Options as for prefill (``sinks`` join in the combine). Everything is checked
        on the host before the row is appended. Where the format has device-position
        kernels, the step runs through them with the position staged in device
        memory: every launch argument is then the same from step to step, so each
        launch replays a remembered binding (the host plan and the device plan are
        one formula: the results are bit-identical).

        With no plan given, a plan and variant tuned for this GPU (`kgen tune`) are
        used when one is stored for the shape class, else the plan derived from the
        device and the kernel (kgen.runtime.plan.default_plan): more splits as the
        context grows, capped at a multiple of the SM count.

        Past every decode kernel's group bound (more q heads per kv head than any
        decode holds) the step runs as a one-row prefill (_decode_by_prefill).

        A step with the signature of an earlier one (q's shape, the options and the
        plan, each of the same type) reuses what that one derived: the checked
        options, the kernels, the scratch and the launch arguments; the arrays'
        types, shapes and dtypes and the position are compared every time."""
        if getattr(q, "ndim", 0) == 3 and q.shape[0] == 1:  # token-major [1][n_head][hd]
            return self.decode(q[0], k_new, v_new, pos, kps, splits_cap, attn_sink, attn_win,
                               scale, window_size, softcap, sinks, stream)[None]
        key = None
        if sinks is None:
            try:
                key = replay.signature(q, kps, splits_cap, attn_sink, attn_win, scale, window_size,
                                       softcap)
                step = self._steps.get(key)
            except (AttributeError, TypeError):
                key = step = None
            if step is not None and type(pos) is int:
                out = replay.replay(self, step, q, k_new, v_new, pos, stream)
                if out is not None:
                    return out
        G = self._check_decode(q, k_new, v_new)
        self._check_span(pos, 1)
        opts = self._options(q.shape[0], attn_sink, attn_win, scale, window_size, softcap, sinks)
        if self.kernels.by_prefill("decode", "prefill", G, opts, kps, splits_cap, "KVCache",
                                   "a one-row prefill, which splits its keys by its own "
                                   "rule"):
            return self._decode_by_prefill(q, k_new, v_new, pos, stream,
                                           dict(attn_sink=attn_sink, attn_win=attn_win,
                                                scale=scale, window_size=window_size,
                                                softcap=softcap,
                                                sinks=sinks))
        source = "given"
        tuned = kps is None and splits_cap is None and not opts.needs("decode")
        if tuned:
            kps, splits_cap = self._tuned_plan(G, pos + 1)
            source = "default" if kps is None else "tuned"
        kps, splits_cap = self.plan(G, kps, splits_cap, opts)
        plan = (kps, splits_cap, source)
        needs = {r: opts.needs(r) for r in ("decode_dev", "combine_dev")}
        if self.kernels.has("decode_dev", "append_dev", "combine_dev", groups=G, needs=needs):
            staged = Pending((1,), np.int32, lambda: self._staged(pos, stream),
                             np.array([pos], np.int32))
            version, calls = self.kernels.version, []
            out = self._device_step(q, k_new, v_new, staged, kps, splits_cap, opts, None,
                                    False, stream, calls)  # pos is checked (_check_span)
            self.length, self.last_plan = max(self.length, pos + 1), plan
            if key is not None:
                replay.remember(self, key, q, k_new, v_new, G, tuned, plan, version, calls)
            return out
        out = self._decode_host(q, k_new, v_new, pos, kps, splits_cap, G, opts, stream)
        self.last_plan = plan
        return out

    def _decode_by_prefill(self, q, k_new, v_new, pos: int, stream, options: dict):
        """decode where only a prefill serves the group count (CacheKernels.by_prefill):
        the token as a prefill of one row at ``pos`` -- its K/V row appended, the row
        attending keys [0, pos] with the same options, as a decode step does -- run by the
        query tile, whose rows pack the q heads (its split form where its tiles are few).
        [n_head][head_dim], as decode returns."""
        out = self.prefill(q.reshape(1, *q.shape), k_new, v_new, pos, stream=stream, **options)
        self.last_plan = (0, 0, "prefill")
        return out.reshape(q.shape)

    def _prefill_kernel(self, groups: int, rows: int, needs: tuple):
        """The prefill kernel for batches of ``rows``: a named variant, else the one
        `kgen tune` stored for the class (when no option is asked for), else the
        kernel ranked first."""
        if not needs and "prefill" not in self.kernels.variants:
            c = store.tuned_prefill(self.kv, self.head_dim, groups, rows)
            if c is not None:
                hit = self.kernels.named("prefill", groups, c.kernel)
                if hit is not None:
                    return hit
        return self.kernels.get("prefill", groups, needs=needs, rows=rows)

    def _staged(self, pos: int, stream):
        """The device copy of the decode position, holding ``pos`` in stream order."""
        if self._pos is None:
            self._pos = device.cupy().zeros(1, np.int32)
        replay.stage(self._pos, pos, stream)
        return self._pos

    def plan(self, groups: int, kps=None, splits_cap=None, opts=None) -> tuple[int, int]:
        """(kps, splits_cap) checked: the given ones, the missing ones derived from the
        device for the decode kernel that serves ``groups`` (q heads per kv head) with the
        options ``opts`` (Options.checked; None: none) (kgen.runtime.plan)."""
        count("groups", groups, 1)
        if opts is not None and not isinstance(opts, Options):
            raise ContractError("KVCache", "type", "opts must be the call's Options "
                                f"(kgen.runtime.options.Options.checked) or None, not {opts!r}")
        kps, splits_cap = given_plan(kps, splits_cap)
        if kps is None or splits_cap is None:  # asks the device (read-only) for its SMs
            needs = opts.needs("decode") if opts is not None else ()
            key = (groups, tuple(needs), self.kernels.version)
            derived = self._default_plans.get(key)
            if derived is None:
                k, _ = self.kernels.get("decode", groups, needs=needs)
                derived = self._default_plans[key] = kernel_plan(k, self.head_dim,
                                                                 self.n_head_kv)
            kps = derived[0] if kps is None else kps
            splits_cap = derived[1] if splits_cap is None else splits_cap
        return kps, splits_cap

    def _tuned_plan(self, groups: int, seq_len: int) -> tuple[int | None, int | None]:
        """(kps, splits_cap) stored by `kgen tune`, adopting its variant for decode
        (and the device-position sibling of that variant) unless variants were named."""
        c = store.tuned(self.kv, self.head_dim, groups, seq_len)
        if c is None:
            return None, None
        self.kernels.prefer("decode", c.kernel, groups)
        return c.kps, c.splits_cap

    def _decode_host(self, q, k_new, v_new, pos, kps, splits_cap, G, opts, stream):
        """The host-plan form: split kernel over the live plan + combine."""
        kdec, fdec = self.kernels.get("decode", G, needs=opts.needs("decode"))
        kc, fcomb = self.kernels.get("combine", needs=opts.needs("combine"))
        plan = decode_plan(pos + 1, kps, splits_cap, kdec.tile_keys)
        calls = Calls()
        self._append_calls(calls, k_new, v_new, pos)
        n_head = q.shape[0]
        m, l, acc = self.scratch.pending(n_head, plan.n_splits, self.head_dim)
        calls.add(fdec, q, self.k, self.v, *self.shadows, m, l, acc, seq_len=plan.seq_len,
                  n_splits=plan.n_splits, split_len=plan.split_len, **self._shadow_args,
                  **opts.kwargs(kdec))
        out = empty((n_head, self.head_dim))
        calls.add(fcomb, m, l, acc, out, *opts.combine_arrays(kc), n_splits=plan.n_splits)
        calls.run(stream)
        self.length = max(self.length, pos + 1)
        return out.made()

    @public("KVCache.decode_device", widen_args=("q", "k_new", "v_new"),
            arrays=("sinks", "pos_dev", "out"))
    def decode_device(self, q, k_new, v_new, pos_dev, kps: int | None = None,
                      splits_cap: int | None = None, attn_sink: int = 0,
                      attn_win: int = 0, scale: float | None = None,
                      window_size: tuple[int, int] | None = None, softcap: float = 0.0,
                      sinks=None, out=None, validate: bool | None = None, stream=None):
        """decode with the position in device memory (capturable in a CUDA graph):
        every launch argument and grid is position-invariant. ``pos_dev``: int32 [1];
        ``out``: float32 [n_head][head_dim], or None for a new one. Every launch is
        checked before the first runs; with ``validate`` (a device-to-host read; None,
        the default: unless the stream is capturing a graph)
        that includes the position, and ``length`` advances past it as decode's does;
        without it (in a graph capture, say) the caller keeps it in [0, max_seq) and
        the host does not know it: ``length`` stays."""
        G = self._check_decode(q, k_new, v_new)
        opts = self._options(q.shape[0], attn_sink, attn_win, scale, window_size, softcap, sinks)
        kps, splits_cap = self.plan(G, kps, splits_cap, opts)
        if tuple(getattr(pos_dev, "shape", ())) != (1,):
            raise ContractError("KVCache", "shape", "pos_dev must be int32 [1] (the decode "
                                f"position), not {type(pos_dev).__name__} "
                                f"{tuple(getattr(pos_dev, 'shape', ()))}")
        want = (q.shape[0], self.head_dim)
        if out is not None and tuple(getattr(out, "shape", ())) != want:
            raise ContractError("KVCache", "shape", f"out must be float32 [{want[0]}]"
                                f"[{want[1]}] (n_head, head_dim), not "
                                f"{tuple(getattr(out, 'shape', ()))}")
        validate_pos = read_back(validate, stream, "KVCache")
        out = self._device_step(q, k_new, v_new, pos_dev, kps, splits_cap, opts, out,
                                validate_pos, stream)
        if validate_pos:  # the check read it already: the position is known and checked
            self.length = max(self.length, int(np.asarray(pos_dev.get())[0]) + 1)
        return out

    def _device_step(self, q, k_new, v_new, pos_dev, kps, splits_cap, opts, out,
                     validate_pos, stream, calls: list | None = None):
        """The three device-position launches, checked together before the first runs
        (``validate_pos``: the check reads pos_dev); ``calls`` collects (launcher,
        Launch) of each."""
        G = self._groups(q)
        kdec, fdec = self.kernels.get("decode_dev", G, needs=opts.needs("decode_dev"))
        _, fapp = self.kernels.get("append_dev")
        kc, fcomb = self.kernels.get("combine_dev", tile=kdec.tile_keys,
                                     needs=opts.needs("combine_dev"))
        n_head = q.shape[0]
        m, l, acc = self.scratch.pending(n_head, splits_cap, self.head_dim)
        out = empty((n_head, self.head_dim)) if out is None else out
        step = Calls()
        step.add(fapp, k_new, v_new, self.k, self.v, *self.shadows, pos_dev, **self._shadow_args,
                 validate_pos=validate_pos)
        step.add(fdec, q, self.k, self.v, *self.shadows, m, l, acc, pos_dev, kps=kps,
                 splits_cap=splits_cap, **self._shadow_args, **opts.kwargs(kdec),
                 validate_pos=validate_pos)
        step.add(fcomb, m, l, acc, out, *opts.combine_arrays(kc), pos_dev, kps=kps,
                 splits_cap=splits_cap, validate_pos=validate_pos)
        launched = step.run(stream)
        if calls is not None:
            calls += launched
        return out.made() if isinstance(out, Pending) else out


def allocate(fmt, lead: tuple[int, ...], max_seq: int, head_dim: int, ring_rows: int,
             sink_rows: int) -> list:
    """Zeroed body (K, V) and shadow arrays in ``fmt``'s layout (a format, or a pair:
    each role's rows in its format), argument order."""
    cp = device.cupy()
    fmt = as_pair(fmt)
    if not fmt.accepts_head_dim(head_dim):
        raise ContractError("KVCache", "row format", f"head_dim = {head_dim} is not whole "
                            f"{fmt.name} blocks of {fmt.block}")
    rows = {"ring_rows": ring_rows, "sink_rows": sink_rows}
    return [*(cp.zeros((*lead, max_seq, f.row_width(head_dim)), f.dtype)
              for f in (fmt.k, fmt.v)),
            *(cp.zeros((*lead, rows[s.rows_key], head_dim), cp.float16)
              for s in fmt.shadow_buffers())]


class SlotKVCache:
    """Independent users, one ring per slot, each decoding at its own position."""

    def __init__(self, nslots: int, n_head_kv: int, head_dim: int, max_seq: int,
                 kv: str = DEFAULT_KV, sink: int = 0, win: int = 0,
                 variants: dict[str, str] | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0, v_kv: str | None = None):
        self.nslots = positive("nslots", nslots)
        # Slot 0 as a plain cache validates every argument and fixes the layout.
        probe = KVCache(n_head_kv, head_dim, max_seq, kv, sink, win, variants,
                        buffers=(None, None), k_scale=k_scale, v_scale=v_scale, v_kv=v_kv)
        self.k_scale, self.v_scale = probe.k_scale, probe.v_scale
        self.kv, self.fmt, self.kernels = kv, probe.fmt, probe.kernels
        self.v_kv, self.pair = probe.v_kv, probe.pair
        self.n_head_kv, self.head_dim, self.max_seq = n_head_kv, head_dim, max_seq
        self.sink, self.win = probe.sink, probe.win
        self.RING_ROWS, self.SINK_ROWS = probe.RING_ROWS, probe.SINK_ROWS
        self.variants = variants
        self.scratch = Scratch()
        self.k, self.v, *shadows = allocate(self.pair, (nslots, n_head_kv), max_seq, head_dim,
                                            self.RING_ROWS, self.SINK_ROWS)
        self.shadows = tuple(shadows)

    _shadow_args = KVCache._shadow_args

    def slot(self, u: int, prefill_kernel: str | None = None) -> KVCache:
        """Slot ``u``'s rings as a single-sequence KVCache (views, no copy): its
        slice of the per-slot layout is laid out exactly like one sequence's cache,
        so prefill (chunked) and append run on it unchanged."""
        if not is_int(u) or not 0 <= u < self.nslots:
            raise ContractError("SlotKVCache", "slot", f"slot {u!r} of {self.nslots} (slots "
                                f"are 0..{self.nslots - 1})")
        bufs = (self.k[u], self.v[u], *(s[u] for s in self.shadows))
        return KVCache(self.n_head_kv, self.head_dim, self.max_seq, kv=self.kv, sink=self.sink,
                       win=self.win, variants=self.variants, prefill_kernel=prefill_kernel,
                       buffers=bufs, k_scale=self.k_scale, v_scale=self.v_scale,
                       v_kv=self.v_kv)

    def prefill(self, u: int, q, k_new, v_new, pos0: int, **kw):
        """Prefill one user's prompt into its own ring; returns [n][n_head][head_dim]
        (KVCache.prefill's convention: that call is the public one)."""
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
            if not is_int(p):
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

    @public("SlotKVCache.append", widen_args=("k_new", "v_new"), host_ok=("pos",))
    def append(self, k_new, v_new, pos, stream=None) -> None:
        """Each slot's one new row at its own position (device or host int32 positions)."""
        calls = Calls()
        self._append_calls(calls, k_new, v_new, pos)
        calls.run(stream)

    def _append_calls(self, calls: Calls, k_new, v_new, pos) -> None:
        self._check_slot_rows("k_new", k_new)
        self._check_slot_rows("v_new", v_new)
        on_device = type(pos).__module__.split(".")[0] == "cupy"  # checked by the launcher
        if not (on_device or isinstance(pos, Pending)):
            pos = upload(np.array(self._positions(pos), np.int32))
        _, fn = self.kernels.get("append_slots")
        calls.add(fn, k_new, v_new, self.k, self.v, *self.shadows, pos, **self._shadow_args,
                  validate_pos=not isinstance(pos, Pending))  # an upload: checked positions

    @public("SlotKVCache.decode", widen_args=("q", "k_new", "v_new"), host_ok=("pos",),
            out_like="q")
    def decode(self, q, k_new, v_new, pos, kps: int | None = None,
               splits_cap: int | None = None, attn_sink: int = 0, attn_win: int = 0,
               scale: float | None = None, window_size: tuple[int, int] | None = None,
               softcap: float = 0.0, stream=None):
        """Each slot appends its row at pos[slot] and attends its own ring.

        ``pos``: host ints (one per slot) or a device int32 array. Returns
        [nslots, n_head, head_dim]. Everything is checked before any row is written.
        Past every per-slot decode's group bound, each slot's step is a one-row prefill
        (_decode_by_prefill).
        """
        pos_host = self._positions(pos)
        self._check_slot_rows("q", q, n_head=0)
        self._check_slot_rows("k_new", k_new)
        self._check_slot_rows("v_new", v_new)
        n_head = q.shape[1]
        G = groups(n_head, self.n_head_kv, "SlotKVCache")
        opts = Options.checked(n_head, attn_sink, attn_win, scale, window_size, softcap, None, True)
        if self.kernels.by_prefill("decode_slots", "prefill", G, opts, kps, splits_cap,
                                   "SlotKVCache", "one-row prefills, which split their keys "
                                   "by their own rule"):
            return self._decode_by_prefill(q, k_new, v_new, pos_host, G, opts, stream)
        kdec, fdec = self.kernels.get("decode_slots", G, needs=opts.needs("decode_slots"))
        _, fcomb = self.kernels.get("combine")
        kps, splits_cap = kernel_plan(kdec, self.head_dim, self.n_head_kv, kps, splits_cap,
                                      "SlotKVCache", len(pos_host))
        width = max(decode_plan(p + 1, kps, splits_cap, kdec.tile_keys).n_splits
                    for p in pos_host)
        pos_dev = upload(np.array(pos_host, np.int32))
        calls = Calls()
        self._append_calls(calls, k_new, v_new, pos_dev)
        heads = self.nslots * n_head
        m, l, acc = self.scratch.pending(heads, width, self.head_dim)
        calls.add(fdec, q, self.k, self.v, *self.shadows, m, l, acc, pos_dev, kps=kps,
                  splits_cap=splits_cap, **self._shadow_args, **opts.kwargs(kdec),
                  launch_splits=width, validate_pos=False)
        out = empty((heads, self.head_dim))
        calls.add(fcomb, m, l, acc, out, n_splits=width)
        calls.run(stream)
        return out.made().reshape(self.nslots, n_head, self.head_dim)

    def _decode_by_prefill(self, q, k_new, v_new, pos_host: list[int], G: int, opts: Options,
                           stream):
        """decode where only a prefill serves ``G`` (CacheKernels.by_prefill): each slot's
        token as a one-row prefill into its own ring (KVCache's _decode_by_prefill, slot by
        slot), every launch in one checked batch."""
        calls, out = Calls(), empty(q.shape)
        for u, p in enumerate(pos_host):
            view = self.slot(u)
            view.prefill_scratch = self.scratch  # a split's partials: one scratch, in turn
            kp, fn = view._prefill_kernel(G, 1, opts.needs("prefill"))
            view._append_calls(calls, k_new[u:u + 1], v_new[u:u + 1], p)
            view._attend(calls, q[u:u + 1], out[u:u + 1], p, kp, fn, opts)
        calls.run(stream)
        return out.made()
