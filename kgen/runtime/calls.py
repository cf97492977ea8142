"""The launches of one cache call, checked together before any of them runs.

A cache object (kgen.runtime.kv, kgen.runtime.paged) collects every launch a call
will make into :class:`Calls`, with kgen.runtime.pending's stand-ins where it makes
an array itself (an output, scratch, an uploaded block table, the staged decode
position); ``Calls.run`` first checks each launch against its kernel's contracts
(kgen.runtime.launch.check_call: the launcher's own checks, and every array on
the current device), and only then makes the pending arrays and launches. So a
refusal comes before the cache touches the GPU or its own state, and the rules
are the launchers' (no second copy).
"""

from __future__ import annotations

from kgen.runtime import launch as launching
from kgen.runtime.contracts import Checker
from kgen.runtime.pending import made


class Calls:
    """Launches to check together, then run in order: (launcher, arrays, keywords)."""

    def __init__(self):
        self.items: list[tuple] = []
        self.sources: list[tuple[str, str, object]] = []

    def add(self, fn, *arrays, **kw) -> None:
        """``fn(*arrays, **kw)`` later. ``validate_pos`` (where the launcher takes it)
        applies to the check: true where the caller passed device positions, which the
        check then reads back; the launch never reads them again."""
        self.items.append((fn, arrays, kw))

    def source(self, fn, name: str, a) -> None:
        """An array that reaches ``fn``'s kernel only through a Pending made from it
        (e.g. sinks tiled per sequence): checked to be on the current device and on its
        element's boundary (the copy reads it element by element)."""
        self.sources.append((fn.kernel.name, name, a))

    def check(self) -> list:
        """Every launch checked; the binding each made (None: one like it launched
        before)."""
        bound = [launching.check_call(fn, *arrays, **kw) for fn, arrays, kw in self.items]
        for kernel, name, a in self.sources:
            launching.check_array(kernel, name, a)
            Checker(kernel).aligned(name, a, a.dtype.itemsize)
        return bound

    def run(self, stream=None) -> list[tuple[object, launching.Launch]]:
        """Check every launch, then make the pending arrays and launch (a binding the
        check made is launched as it is); returns (launcher, Launch) of each."""
        bound = self.check()
        out = []
        for (fn, arrays, kw), b in zip(self.items, bound, strict=True):
            kw = {k: made(v) for k, v in kw.items()}
            if "validate_pos" in kw:
                kw["validate_pos"] = False  # the check read them
            arrays = tuple(map(made, arrays))
            out.append((fn, fn(*arrays, **kw, stream=stream) if b is None else
                        launching.launch_checked(fn, b, arrays, kw, stream)))
        return out
