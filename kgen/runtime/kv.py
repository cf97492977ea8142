"""KV-cache objects: append, prefill and decode over the generated kernels.

This is the layer a host engine would otherwise write by hand: it owns the
cache buffers (f32; q4 with its fp16 sink and window shadows; one ring per
slot), computes the decode split plan on the host, keeps scratch for the
partials, runs decode as split kernel + combine, and splits a long q4 prefill
into chunks so the fp16 window ring is never lapped inside one batch.
"""

from __future__ import annotations

from kgen.geometry import q4_row_bytes
from kgen.runtime.contracts import ContractError
from kgen.runtime.plan import decode_plan


def _kernels():
    import kgen_kernels

    return kgen_kernels


def shadow_rows() -> tuple[int, int]:
    """(ring_rows, sink_rows) of the fp16 shadows, as the q4 kernels were generated
    (the specs' ring_rows / sink_rows): the cache layout every q4 kernel indexes."""
    rows = {(k.ring_rows, k.sink_rows) for m in _kernels().MODULES.values()
            for k in m.KERNELS.values() if k.kv.value == "q4"}
    if len(rows) != 1:
        raise ValueError(f"the q4 kernels disagree on the shadow layout: {sorted(rows)}")
    return rows.pop()


def _cp():
    import cupy

    return cupy


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


class KVCache:
    """One sequence's cache on the GPU: ``kv="f32"`` or ``kv="q4"``.

    q4 keeps the Q4_0 body for every position plus fp16 copies of the first
    ``sink`` positions and of the last ``win`` positions (a ring of
    ``ring_rows``), which the attention kernels read instead of the q4 body.
    """

    def __init__(self, n_head_kv: int, head_dim: int, max_seq: int, kv: str = "f32",
                 sink: int = 0, win: int = 0, prefill_kernel: str | None = None,
                 buffers: tuple | None = None):
        cp = _cp()
        if kv not in ("f32", "q4"):
            raise ValueError(f"kv must be 'f32' or 'q4', not {kv!r}")
        self.kv, self.n_head_kv, self.head_dim, self.max_seq = kv, n_head_kv, head_dim, max_seq
        self.sink, self.win = sink, win
        self.length = 0  # positions [0, length) hold keys
        self.scratch = _Scratch()
        self.RING_ROWS, self.SINK_ROWS = shadow_rows() if kv == "q4" else (0, 0)
        if buffers is not None:  # a view of arrays owned elsewhere (one slot's rings)
            self.k, self.v, *shadows = buffers
            if kv == "q4":
                self.k_sink, self.v_sink, self.k_win, self.v_win = shadows
            self.prefill_kernel = prefill_kernel or (
                "fc_attn_flash_prefill" if kv == "f32" else "fc_attn_flash_prefill_q4")
            return
        if kv == "f32":
            shape = (n_head_kv, max_seq, head_dim)
            self.k, self.v = cp.zeros(shape, cp.float32), cp.zeros(shape, cp.float32)
            self.prefill_kernel = prefill_kernel or "fc_attn_flash_prefill"
        else:
            row = q4_row_bytes(head_dim)
            self.k = cp.zeros((n_head_kv, max_seq, row), cp.uint8)
            self.v = cp.zeros((n_head_kv, max_seq, row), cp.uint8)
            self.k_sink = cp.zeros((n_head_kv, self.SINK_ROWS, head_dim), cp.float16)
            self.v_sink = cp.zeros_like(self.k_sink)
            self.k_win = cp.zeros((n_head_kv, self.RING_ROWS, head_dim), cp.float16)
            self.v_win = cp.zeros_like(self.k_win)
            self.prefill_kernel = prefill_kernel or "fc_attn_flash_prefill_q4"

    @property
    def _shadows(self) -> tuple:
        return (self.k_sink, self.v_sink, self.k_win, self.v_win) if self.kv == "q4" else ()

    @property
    def _q4_args(self) -> dict:
        return {"sink": self.sink, "win": self.win} if self.kv == "q4" else {}

    def max_prefill_chunk(self) -> int:
        """Rows one q4 prefill batch may have so no row's window key is lapped.

        All rows of a batch are appended before any is read; the window ring
        laps at RING_ROWS, so row 0 (needing keys > pos0 - win) stays exact
        while the batch ends before pos0 - win + RING_ROWS.
        """
        if self.kv != "q4" or self.win <= 0:
            return self.max_seq
        return self.RING_ROWS - self.win + 1

    def append(self, k_new, v_new, pos0: int, stream=None) -> None:
        """Append rows [pos0, pos0 + n). A q4 batch longer than the fp16 ring is
        appended in ring-sized launches (in one launch, two blocks would race
        for a ring slot); launches on one stream run in order."""
        kk = _kernels()
        name = "fc_attn_kv_append" if self.kv == "f32" else "fc_attn_kv_append_q4"
        n = k_new.shape[0]
        step = self.RING_ROWS if self.kv == "q4" and self.win > 0 else max(n, 1)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            getattr(kk, name)(k_new[lo:hi], v_new[lo:hi], self.k, self.v, *self._shadows,
                              pos0=pos0 + lo, **self._q4_args, stream=stream)
        self.length = max(self.length, pos0 + n)

    def prefill(self, q, k_new, v_new, pos0: int, attn_sink: int = 0, attn_win: int = 0,
                scale: float | None = None, stream=None):
        """Append rows [pos0, pos0+n) and attend each query row causally; returns out."""
        cp = _cp()
        n = q.shape[0]
        out = cp.empty(q.shape, cp.float32)
        step = self.max_prefill_chunk()
        kk = _kernels()
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            self.append(k_new[lo:hi], v_new[lo:hi], pos0 + lo, stream=stream)
            getattr(kk, self.prefill_kernel)(
                q[lo:hi], self.k, self.v, *self._shadows, out[lo:hi], pos0=pos0 + lo,
                **self._q4_args, attn_sink=attn_sink, attn_win=attn_win, scale=scale,
                stream=stream)
        return out

    def decode(self, q, k_new, v_new, pos: int, kps: int = 256, splits_cap: int = 16,
               attn_sink: int = 0, attn_win: int = 0, scale: float | None = None,
               stream=None):
        """Append the token at ``pos``, then split decode + combine; returns [n_head, hd]."""
        cp = _cp()
        self.append(k_new, v_new, pos, stream=stream)
        plan = decode_plan(pos + 1, kps, splits_cap)
        n_head = q.shape[0]
        m, l, acc = self.scratch.get(n_head, plan.n_splits, self.head_dim)
        kk = _kernels()
        name = "fc_attn_flash_decode" if self.kv == "f32" else "fc_attn_flash_decode_q4"
        getattr(kk, name)(q, self.k, self.v, *self._shadows, m, l, acc, seq_len=plan.seq_len,
                          n_splits=plan.n_splits, split_len=plan.split_len, **self._q4_args,
                          attn_sink=attn_sink, attn_win=attn_win, scale=scale, stream=stream)
        out = cp.empty((n_head, self.head_dim), cp.float32)
        kk.fc_attn_flash_decode_combine(m, l, acc, out, n_splits=plan.n_splits, stream=stream)
        return out

    def decode_device(self, q, k_new, v_new, pos_dev, kps: int = 256, splits_cap: int = 16,
                      attn_sink: int = 0, attn_win: int = 0, scale: float | None = None,
                      out=None, validate_pos: bool = True, stream=None):
        """decode with the position in device memory (capturable in a CUDA graph):
        every launch argument and grid is position-invariant."""
        cp = _cp()
        kk = _kernels()
        q4 = self.kv == "q4"
        n_head = q.shape[0]
        m, l, acc = self.scratch.get(n_head, splits_cap, self.head_dim)
        (kk.fc_attn_kv_append_q4_dev if q4 else kk.fc_attn_kv_append_dev)(
            k_new, v_new, self.k, self.v, *self._shadows, pos_dev, **self._q4_args,
            validate_pos=validate_pos, stream=stream)
        (kk.fc_attn_flash_decode_q4_dev if q4 else kk.fc_attn_flash_decode_dev)(
            q, self.k, self.v, *self._shadows, m, l, acc, pos_dev, kps=kps,
            splits_cap=splits_cap, **self._q4_args, attn_sink=attn_sink, attn_win=attn_win,
            scale=scale, validate_pos=validate_pos, stream=stream)
        out = cp.empty((n_head, self.head_dim), cp.float32) if out is None else out
        kk.fc_attn_flash_decode_combine_dev(m, l, acc, out, pos_dev, kps=kps,
                                            splits_cap=splits_cap, validate_pos=validate_pos,
                                            stream=stream)
        return out


class SlotKVCache:
    """Independent users, one ring per slot, each decoding at its own position."""

    def __init__(self, nslots: int, n_head_kv: int, head_dim: int, max_seq: int,
                 kv: str = "f32", sink: int = 0, win: int = 0):
        cp = _cp()
        self.kv, self.nslots, self.n_head_kv = kv, nslots, n_head_kv
        self.head_dim, self.max_seq, self.sink, self.win = head_dim, max_seq, sink, win
        self.scratch = _Scratch()
        lead = (nslots, n_head_kv)
        if kv == "f32":
            self.k = cp.zeros((*lead, max_seq, head_dim), cp.float32)
            self.v = cp.zeros_like(self.k)
            self.shadows = ()
        elif kv == "q4":
            self.k = cp.zeros((*lead, max_seq, q4_row_bytes(head_dim)), cp.uint8)
            self.v = cp.zeros_like(self.k)
            ring, sink_rows = shadow_rows()
            self.shadows = tuple(cp.zeros((*lead, rows, head_dim), cp.float16)
                                 for rows in (sink_rows, sink_rows, ring, ring))
        else:
            raise ValueError(f"kv must be 'f32' or 'q4', not {kv!r}")

    def slot(self, u: int, prefill_kernel: str | None = None) -> KVCache:
        """Slot ``u``'s rings as a single-sequence KVCache (views, no copy): its
        slice of the per-slot layout is laid out exactly like one sequence's cache,
        so prefill (chunked for q4) and append run on it unchanged."""
        if not 0 <= u < self.nslots:
            raise IndexError(f"slot {u} of {self.nslots}")
        bufs = (self.k[u], self.v[u], *(s[u] for s in self.shadows))
        return KVCache(self.n_head_kv, self.head_dim, self.max_seq, kv=self.kv, sink=self.sink,
                       win=self.win, prefill_kernel=prefill_kernel, buffers=bufs)

    def prefill(self, u: int, q, k_new, v_new, pos0: int, **kw):
        """Prefill one user's prompt into its own ring; returns [n][n_head][head_dim]."""
        return self.slot(u).prefill(q, k_new, v_new, pos0, **kw)

    def append(self, k_new, v_new, pos, stream=None) -> None:
        """Each slot's one new row at its own position (device or host int32 positions)."""
        cp = _cp()
        kk = _kernels()
        pos_dev = pos if isinstance(pos, cp.ndarray) else cp.asarray(pos, dtype=cp.int32)
        q4 = self.kv == "q4"
        extra = {"sink": self.sink, "win": self.win} if q4 else {}
        (kk.fc_attn_kv_append_slots_q4 if q4 else kk.fc_attn_kv_append_slots)(
            k_new, v_new, self.k, self.v, *self.shadows, pos_dev, **extra, stream=stream)

    def decode(self, q, k_new, v_new, pos, kps: int = 256, splits_cap: int = 16,
               attn_sink: int = 0, attn_win: int = 0, scale: float | None = None,
               stream=None):
        """Each slot appends its row at pos[slot] and attends its own ring.

        ``pos``: host ints (one per slot) or a device int32 array. Returns
        [nslots, n_head, head_dim].
        """
        cp = _cp()
        kk = _kernels()
        q4 = self.kv == "q4"
        pos_host = [int(p) for p in (pos.get() if hasattr(pos, "get") else pos)]
        if len(pos_host) != self.nslots:
            raise ContractError("SlotKVCache.decode", "shape",
                                f"{len(pos_host)} positions for {self.nslots} slots")
        pos_dev = cp.asarray(pos_host, dtype=cp.int32)
        width = max(decode_plan(p + 1, kps, splits_cap).n_splits for p in pos_host)
        extra = {"sink": self.sink, "win": self.win} if q4 else {}
        self.append(k_new, v_new, pos_dev, stream=stream)
        n_head = q.shape[1]
        heads = self.nslots * n_head
        m, l, acc = self.scratch.get(heads, width, self.head_dim)
        (kk.fc_attn_flash_decode_slots_q4 if q4 else kk.fc_attn_flash_decode_slots)(
            q, self.k, self.v, *self.shadows, m, l, acc, pos_dev, kps=kps,
            splits_cap=splits_cap, **extra, attn_sink=attn_sink, attn_win=attn_win,
            scale=scale, launch_splits=width, stream=stream)
        out = cp.empty((heads, self.head_dim), cp.float32)
        kk.fc_attn_flash_decode_combine(m, l, acc, out, n_splits=width, stream=stream)
        return out.reshape(self.nslots, n_head, self.head_dim)

