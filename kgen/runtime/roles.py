"""The kernels a cache object uses, per role: what each role needs a kernel for,
and the choice for one cache (made on first use and kept), over the same cache
layout for every role."""

from __future__ import annotations

from kgen.formats import pair
from kgen.ir.axes import Mode, Op, Position
from kgen.ops import get
from kgen.runtime.contracts import ContractError
from kgen.runtime.select import Role, fills, find

# What each role of a cache object needs a kernel for (kv is filled in per cache). The
# caches' own vocabulary (the names their variants, has and get take), not a switch on
# an op: each role asks for an op; what an op does is its op object's (kgen.ops).
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


class CacheKernels:
    """The kernels one cache uses, chosen per role on first use and cached. Every
    kernel must lay the cache out alike: the same shadow rows as the append kernel,
    and a device combine planning with the device decode's tile."""

    def __init__(self, kv: str, head_dim: int, variants: dict[str, str] | None,
                 layout_role: str = "append", v_kv: str | None = None):
        self.kv, self.head_dim = kv, head_dim
        self.v_kv = v_kv if v_kv is not None else kv  # the V rows' format
        if not isinstance(variants, dict | None):
            raise ContractError("KVCache", "variant", "variants maps a role to a kernel name "
                                f"(a dict), not {variants!r}")
        self.variants = dict(variants or {})
        unknown = set(self.variants) - set(ROLES)
        if unknown:
            raise ContractError("KVCache", "variant", f"unknown role(s) {sorted(unknown)}; "
                                f"roles are {sorted(ROLES)}")
        self._chosen: dict[tuple[str, int, int | None], tuple] = {}
        self._pinned: set[tuple[str, int, int | None]] = set()
        self.version = 0  # bumped when a choice already made changes (prefer)
        self.layout = self.get(layout_role)[0]  # fixes ring_rows / sink_rows
        for role, name in self.variants.items():  # each named kernel, refused here, not at use
            find(self._role(role), head_dim, 1, name, self._same_layout)

    def _same_layout(self, k) -> bool:
        if not pair(self.kv, self.v_kv).shadows or not hasattr(self, "layout"):
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
        cache = get(base.op).cache
        return Role(base.op, base.position, base.mode, self.kv if cache else None, needs,
                    self.v_kv if cache else None)

    def has(self, *roles: str, groups: int = 1, needs: dict | None = None) -> bool:
        """Whether every role can be served (the device combine at the decode's tile)."""
        try:
            tile = None
            for role in roles:
                k, _ = self.get(role, groups, tile if role.startswith("combine") else None,
                                (needs or {}).get(role, ()))
                if get(k.op).sets_combine_tile:
                    tile = k.tile_keys
        except ContractError:
            return False
        return True

    def by_prefill(self, decode: str, prefill: str, groups: int, opts, kps, splits_cap,
                   who: str, steps: str) -> bool:
        """Whether a decode step runs as one-row prefills (``steps``: how a refusal says
        so): no kernel serves role ``decode`` with ``groups`` q heads per kv head and
        ``opts`` (past every decode's group bound), and one serves role ``prefill``. Such
        a step splits its keys by the prefill's own rule, so a plan given is refused."""
        if self.has(decode, groups=groups, needs={decode: opts.needs(decode)}) or \
                not self.has(prefill, groups=groups, needs={prefill: opts.needs(prefill)}):
            return False
        if kps is not None or splits_cap is not None:
            raise ContractError(who, "plan", f"no decode kernel serves kv_groups = {groups}, so "
                                f"the step runs as {steps}: call without kps and splits_cap")
        return True

    def split(self, k):
        """((split kernel, launcher), (combine, launcher)) for the whole query-tile
        prefill ``k``: its split twin (kgen.runtime.select.split_twin) and the combine
        that folds its partials; None when ``k`` has no twin, or a prefill variant was
        named (the named kernel runs as it is)."""
        key = ("split", k.name)
        if key not in self._chosen:
            from kgen.runtime.select import generated, split_twin

            named = {"prefill", "prefill_paged"} & set(self.variants)
            twin = None if named else split_twin(k, generated())
            self._chosen[key] = None if twin is None else (twin, self.get("combine"))
        return self._chosen[key]

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

    def get(self, role: str, groups: int = 1, tile: int | None = None, needs: tuple = (),
            rows: int | None = None):
        """The kernel for ``role``; ``needs``: option axes it must have (e.g. an exact
        window), from what the call asked for; ``rows``: a prefill's query rows (a paged
        batch's longest request: select.fills)."""
        key = (role, groups, tile, needs) if needs else (role, groups, tile)
        if rows is not None:  # the choice for any batch, unless the rows do not fill it
            key += (fills(self.get(role, groups, tile, needs)[0], rows, groups),)
        if key not in self._chosen:
            def where(k):
                return self._same_layout(k) and (tile is None or k.tile_keys == tile)
            self._chosen[key] = find(self._role(role, needs), self.head_dim, groups,
                                     self.variants.get(role), where, rows=rows)
        return self._chosen[key]
