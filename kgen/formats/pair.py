"""A cache's pair of formats: K rows in one registered format, V rows in another
(or the same: every cache before mixed formats was such a pair).

What a cache, a launch contract or a reference asks of the pair as a whole (its
shadow buffers and scalars, its per-tensor scales, whether appends wrap, which
head sizes it serves) is answered here from the two format objects; what one
role's rows are (their element type, width, NumPy model) is asked of that role's
format, ``pair.of(role)``. A pair of one format answers exactly as that format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kgen.formats.base import ROLES, SHADOW_SCALARS, SHADOWS, TENSOR_SCALES, KvFormat, Shadow


@dataclass(frozen=True)
class KvPair:
    k: KvFormat  # the format of the K rows
    v: KvFormat  # the format of the V rows

    def of(self, role: str) -> KvFormat:
        """The format of ``role``'s rows (``k`` or ``v``)."""
        return {"k": self.k, "v": self.v}[role]

    @property
    def mixed(self) -> bool:
        return self.k is not self.v

    @property
    def name(self) -> str:
        """The pair as a cache and an error message name it: ``q8_0``, or ``q8_0/q4``
        (K's format, then V's)."""
        return self.k.name if not self.mixed else f"{self.k.name}/{self.v.name}"

    @property
    def shadows(self) -> bool:
        """Either role keeps fp16 sink/window shadows (the shadow scalars are taken)."""
        return self.k.shadows or self.v.shadows

    def shadow_buffers(self) -> tuple[Shadow, ...]:
        """The fp16 shadows of the roles whose format keeps them, in argument order."""
        return tuple(s for s in SHADOWS if self.of(s.role).shadows)

    def shadow_scalars(self) -> tuple[str, ...]:
        return SHADOW_SCALARS if self.shadows else ()

    def scale_scalars(self) -> tuple[str, ...]:
        """The per-tensor scales of the roles whose format has them (k_scale, v_scale)."""
        return tuple(n for n, r in zip(TENSOR_SCALES, ROLES, strict=True)
                     if self.of(r).tensor_scales)

    @property
    def tensor_scales(self) -> bool:
        return bool(self.scale_scalars())

    @property
    def append_wraps(self) -> bool:
        """Rows land at pos % max_seq in both roles (else pos < max_seq is required)."""
        return self.k.append_wraps and self.v.append_wraps

    @property
    def append_staging(self) -> bool:
        return self.k.append_staging or self.v.append_staging

    @property
    def block(self) -> int:
        """head_dim is a multiple of this: both roles' blocks."""
        return math.lcm(self.k.block, self.v.block)

    def accepts_head_dim(self, head_dim: int) -> bool:
        return self.k.accepts_head_dim(head_dim) and self.v.accepts_head_dim(head_dim)

    @property
    def fp16(self) -> bool:
        return self.k.fp16 or self.v.fp16

    def position_bytes(self, head_dim: int) -> int:
        """Bytes of one position's K and V rows together (one kv head)."""
        return self.k.row_bytes(head_dim) + self.v.row_bytes(head_dim)
