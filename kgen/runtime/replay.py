"""The decode steps a KVCache remembers: a step with the signature of an earlier one
(q's shape, the options and the plan, each of the same type) replays the three
launches that one bound (append, decode, combine) with the new arrays, instead of
checking and binding them again. The arrays' types, shapes and dtypes, the
position and every object the cache held when the step was derived are compared
every time; anything different and the caller derives the step in full."""

from __future__ import annotations

from math import copysign

import numpy as np

from kgen.runtime import device
from kgen.runtime import launch as launching
from kgen.runtime import tuned as store

_F32 = np.dtype(np.float32)
STEPS_LIMIT = 64  # decode call signatures a cache remembers before it starts over


class Step:
    """What one decode call signature derived (see KVCache.decode): the plan, or
    with none given the plan per tuned (kps, splits_cap, source)."""

    __slots__ = ("ndarray", "row", "groups", "tuned", "plan", "plans")

    def __init__(self, ndarray, row: tuple, groups: int, tuned: bool):
        self.ndarray, self.row, self.groups, self.tuned = ndarray, row, groups, tuned
        self.plan: Plan | None = None
        self.plans: dict[tuple, Plan] = {}


class Plan:
    """One step's three launches (append, decode, combine) bound together, and the
    cache state they were derived from: the objects the cache held (buffers, shadow
    counts and scales: a replay needs the very same ones) and the kernel choice."""

    __slots__ = ("version", "last_plan", "k", "v", "shadows", "pos", "scratch", "sink", "win",
                 "k_scale", "v_scale", "replay", "empty", "out_shape")


def signature(q, kps, splits_cap, attn_sink, attn_win, scale, window, softcap) -> tuple:
    """The key of a decode call without sinks: q's shape, the options and the plan,
    each with its type (AttributeError or TypeError for arguments that have none)."""
    return (q.shape, kps, splits_cap, attn_sink, attn_win, scale, window, softcap,
            copysign(1.0, softcap), type(kps), type(splits_cap), type(attn_sink),
            type(attn_win), type(scale), type(softcap), type(window),
            *(map(type, window) if type(window) is tuple else ()))


def stage(pos_dev, pos: int, stream) -> None:
    """Write the decode position into device memory in stream order. A fill kernel,
    not a copy: a copy from pageable host memory waits for the stream to drain first,
    which would stall the host on the previous step's kernels every step."""
    if stream is None:
        pos_dev.fill(pos)
    else:
        with stream:
            pos_dev.fill(pos)


def _function(fn, b):
    """The CuPy function a generated launcher ``fn`` launched ``b`` with, or None
    for anything but a generated launcher."""
    k, path = getattr(fn, "kernel", None), getattr(fn, "fatbin", None)
    if k is None or path is None or k.name != b.kernel:
        return None
    return launching.function(path, b.kernel, device.cupy().cuda.runtime.getDevice())


def replay(cache, s: Step, q, k_new, v_new, pos: int, stream):
    """A step of ``cache`` like the one ``s`` remembers, or None where anything
    differs (the caller then checks and binds in full)."""
    nd = s.ndarray
    if not (0 <= pos < cache.max_seq and q.__class__ is nd and k_new.__class__ is nd
            and v_new.__class__ is nd and q.dtype is _F32 and k_new.dtype is _F32
            and v_new.dtype is _F32 and k_new.shape == s.row and v_new.shape == s.row):
        return None
    if s.tuned:
        c = store.tuned(cache.kv, cache.head_dim, s.groups, pos + 1)
        if c is None:
            p = s.plans.get((*cache.plan(s.groups), "default"))
        elif type(c.kps) is int and type(c.splits_cap) is int:
            cache.kernels.prefer("decode", c.kernel, s.groups)
            p = s.plans.get((c.kps, c.splits_cap, "tuned"))
        else:
            return None
    else:
        p = s.plan
    if (p is None or p.version != cache.kernels.version or cache.k is not p.k
            or cache.v is not p.v or cache.shadows is not p.shadows or cache._pos is not p.pos
            or cache.scratch.m is not p.scratch or cache.sink is not p.sink
            or cache.win is not p.win or cache.k_scale is not p.k_scale
            or cache.v_scale is not p.v_scale):
        return None
    out = p.empty(p.out_shape, _F32)
    arrays = p.replay.check((k_new, v_new, q, out))
    if arrays is None:
        return None
    cache.last_plan = p.last_plan
    stage(p.pos, pos, stream)
    p.replay.run(arrays, stream)
    if pos >= cache.length:
        cache.length = pos + 1
    return out


def remember(cache, key: tuple, q, k_new, v_new, groups: int, tuned: bool,
             last_plan: tuple, version: int, calls: list) -> None:
    """Keep what a device-position step of ``cache`` derived (``calls``: its
    (launcher, Launch) pairs), for the next step like it."""
    cp = device.cupy()
    nd = cp.ndarray
    if not (q.__class__ is nd and k_new.__class__ is nd and v_new.__class__ is nd
            and q.dtype is _F32 and k_new.dtype is _F32 and v_new.dtype is _F32):
        return
    fns = [_function(fn, b) for fn, b in calls]
    if None in fns or version != cache.kernels.version:
        return
    bound = [(b, f) for (_, b), f in zip(calls, fns, strict=True)]
    swap = ((0, "k_new"), (0, "v_new"), (1, "q"), (2, "out"))  # append, decode, combine
    try:
        launches = launching.Replay(bound, swap, cp.cuda.runtime.getDevice())
    except (TypeError, ValueError):  # an argument not a cupy array, or not there
        return
    p = Plan()
    p.version, p.last_plan, p.replay = version, last_plan, launches
    p.k, p.v, p.shadows, p.pos = cache.k, cache.v, cache.shadows, cache._pos
    p.scratch = cache.scratch.m
    p.sink, p.win, p.k_scale, p.v_scale = cache.sink, cache.win, cache.k_scale, cache.v_scale
    p.empty, p.out_shape = cp.empty, (q.shape[0], cache.head_dim)
    steps = cache._steps
    s = steps.get(key)
    if s is None or s.ndarray is not nd:
        if len(steps) >= STEPS_LIMIT:
            steps.clear()
        s = steps[key] = Step(nd, (1, cache.n_head_kv, cache.head_dim), groups, tuned)
    if tuned:
        s.plans[last_plan] = p
    else:
        s.plan = p
