"""Choose a generated kernel by its axes and the shapes it must serve.

The cache objects never name a kernel: they ask for a role (an op, mode and
position over a KV format) and the shapes at hand, and get the first generated
kernel that serves them, by :func:`rank`, then the generated order. An
explicit variant name overrides the choice and is checked like any other. When
nothing serves, the error names the closest variants and what each refuses.
"""

from __future__ import annotations

from collections.abc import Callable

from kgen.ir.axes import KEYS, LOAD_PLACEMENT, Mode, Position
from kgen.ir.geometry import key_partials, query_tiles
from kgen.ir.kernel import Kernel
from kgen.ir.role import Role
from kgen.ops import get
from kgen.runtime.bind import shape_refusal
from kgen.runtime.contracts import ContractError

# Attention options a kernel may carry; a kernel with options nobody asked for is
# chosen only after the plain ones (its neutral options give the same bits anyway).
OPTION_AXES = ("window", "mask", "softcap", "sinks")


def options(k: Kernel) -> int:
    """How many option axes of ``k`` are off their spec default."""
    return sum(getattr(k, a) != KEYS[a].default for a in OPTION_AXES)


def generated() -> list[tuple[Kernel, Callable]]:
    """Every generated kernel with its launcher, in the generated package's order."""
    from kgen.runtime import package

    return package.generated()


def rank(k: Kernel) -> tuple:
    """Preference among kernels that serve a shape (smaller first): the order of
    ``k``'s op (kgen.ops: ``OpDef.rank``; flash: exact staging, then the query tiles,
    the fewest options nobody asked for, the fast decodes, the widest tile; a combine:
    the staged form first), by default the fewest options nobody asked for."""
    return get(k.op).rank(k, options(k))


# A query_tile prefill pays once a kv head's rows fill this many of its tiles; below,
# the block_tile form (a block per query row) is chosen. Measured on the H200 (make
# bench-kernels, prefill_split: head_dim 128, 32/8 heads, and 16/2 alike, chunks of 1 to
# 512 rows ending at 4096 keys, every output checked): since the swizzled tile and its
# split form (key_split = partials, which fills the device with a few tiles' key
# shares), the query tile wins at every chunk: 4 rows 2.7-3.0 ms block_tile, 0.9-1.2 ms
# whole query tile, 81-102 us split; 32 rows 2.9-3.8 ms, 0.9-1.2 ms, 93-128 us. Before
# them the tile ran at 0.72-1.17x the block_tile speed at one to four tiles, hence the
# rule; it stays for targets where few tiles lose.
MIN_QUERY_TILES = 0


def fills(k: Kernel, rows: int, groups: int) -> bool:
    """Whether a prefill of ``rows`` query rows (a paged batch: its longest request's)
    with ``groups`` q heads per kv head suits ``k``: any kernel but a query tile, which
    wants MIN_QUERY_TILES of its tiles per kv head (with MIN_QUERY_TILES = 0: any rows)."""
    return not query_tiles(k) or rows * groups >= MIN_QUERY_TILES * k.tile_rows


def split_twin(k: Kernel, kernels: list[tuple[Kernel, Callable]]
               ) -> tuple[Kernel, Callable] | None:
    """The split form (key_split = partials) of the whole query-tile prefill ``k``: the
    generated kernel with every other axis of ``k``'s but the load placement
    (LOAD_PLACEMENT: the same arithmetic), the one placing its loads as ``k`` does
    first; None if there is none."""
    from kgen.runtime.record import axes_of

    def rest(x: Kernel) -> dict:
        axes = axes_of(x)
        for key in ("key_split", "doc", "module", *LOAD_PLACEMENT):
            axes.pop(key)
        return axes

    def placed(x: Kernel) -> tuple:
        return tuple(getattr(x, key) for key in LOAD_PLACEMENT)

    if not query_tiles(k) or key_partials(k):
        return None
    want = rest(k)
    twins = [(x, f) for x, f in kernels if key_partials(x) and rest(x) == want]
    return min(twins, key=lambda t: placed(t[0]) != placed(k), default=None)


def find(role: Role, head_dim: int, groups: int = 1, variant: str | None = None,
         where: Callable[[Kernel], bool] | None = None,
         kernels: list[tuple[Kernel, Callable]] | None = None,
         rows: int | None = None) -> tuple[Kernel, Callable]:
    """The kernel (and its launcher) that serves ``role`` at ``head_dim`` with
    ``groups`` q heads per KV head; ``where`` adds a layout constraint (e.g. the
    shadow rows or tile size another kernel already fixed). ``rows``: a prefill's
    query rows (a paged batch's longest request): when they do not fill the query
    tile ranked first (:func:`fills`), the first kernel that is no query tile."""
    pool = generated() if kernels is None else kernels
    if variant is not None:
        hit = [(k, f) for k, f in pool if k.name == variant]
        if not hit:
            raise ContractError(variant, "variant", f"no generated kernel '{variant}'")
        k, f = hit[0]
        why = ("it is a split prefill (key_split = partials), run only as its whole twin's "
               "split form" if key_partials(k) else
               None if role.matches(k) else f"it is {Role.of(k)}, not {role}") \
            or shape_refusal(k, head_dim, groups)
        if why is None and where is not None and not where(k):
            why = "its layout differs from the cache's other kernels"
        if why:
            raise ContractError(variant, "variant", f"cannot serve {role}: {why}")
        return k, f
    fits = [(k, f) for k, f in pool if role.matches(k) and (where is None or where(k))]
    ok = [(k, f) for k, f in fits if shape_refusal(k, head_dim, groups) is None]
    if ok:
        best = min(ok, key=lambda kf: rank(kf[0]))  # min is stable: generated order
        if rows is not None and not fills(best[0], rows, groups):
            # Too few rows for the query tile ranked first: no query tile (one of
            # fewer rows but wider heads is slower than the block_tile form there).
            per_row = [(k, f) for k, f in ok if not query_tiles(k)]
            best = min(per_row, key=lambda kf: rank(kf[0])) if per_row else best
        return best
    near = fits or [(k, f) for k, f in pool if k.op is role.op]
    reasons = "; ".join(f"{k.name}: {shape_refusal(k, head_dim, groups) or 'layout'}"
                        for k, _ in near[:4])
    raise ContractError("kgen.runtime", "no kernel",
                        f"no generated kernel serves {role} at head_dim {head_dim}, kv_groups "
                        f"{groups}" + (f"; closest: {reasons}" if reasons else
                                       " (none has these axes; add a spec)"))


def sibling(name: str, position: Position, kernels: list[tuple[Kernel, Callable]]
            ) -> str | None:
    """The kernel with ``name``'s axes but another position form, if one is generated."""
    from kgen.runtime.record import forms_key

    mine = next((k for k, _ in kernels if k.name == name), None)
    if mine is None:
        return None
    want = forms_key(mine)
    return next((k.name for k, _ in kernels
                 if k.position is position and forms_key(k) == want), None)


def decode_variants(kv: str, head_dim: int, groups: int,
                    where: Callable[[Kernel], bool] = lambda k: True) -> dict[str, str] | None:
    """KVCache variants naming the first generated host-position decode of ``kv`` that
    serves the shape and satisfies ``where``, with its device-position sibling (the
    cache's decode runs through that); None when no such pair is generated."""
    pool = generated()
    for k, _ in pool:  # a decode: mode is the flash kernels' axis (others keep its default)
        if (k.mode is Mode.DECODE and k.position is Position.HOST
                and k.kv.value == kv == k.v_kv.value and where(k)
                and shape_refusal(k, head_dim, groups) is None):
            dev = sibling(k.name, Position.DEVICE, pool)
            if dev is not None:
                return {"decode": k.name, "decode_dev": dev}
    return None
