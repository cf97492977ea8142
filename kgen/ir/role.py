"""What a caller needs a kernel for (a role): the cache objects and the public calls
ask :mod:`kgen.runtime.select` for one, never for a kernel by name."""

from __future__ import annotations

from dataclasses import dataclass

from kgen.ir.axes import Mode, Op, Position
from kgen.ir.geometry import key_partials
from kgen.ir.kernel import Kernel


@dataclass(frozen=True)
class Role:
    """What a caller needs a kernel for."""

    op: Op
    position: Position = Position.HOST
    mode: Mode | None = None      # flash only
    kv: str | None = None         # cache ops only: the K rows' format
    needs: tuple[tuple[str, str], ...] = ()  # option axes that must have these values
    v_kv: str | None = None       # the V rows' format (None: kv's, as every cache of one
    #                               format asks: a mixed kernel never serves it)

    def matches(self, k: Kernel) -> bool:
        """Whether ``k`` serves the role: a split prefill (key_split = partials) serves
        none, being reached only as the twin of the whole one (:func:`split_twin`)."""
        return (k.op is self.op and k.position is self.position and not key_partials(k)
                and (self.mode is None or k.mode is self.mode)
                and (self.kv is None or (k.kv.value == self.kv
                                         and k.v_kv.value == (self.v_kv or self.kv)))
                and all(getattr(k, key).value == value for key, value in self.needs))

    def __str__(self) -> str:
        kv = self.kv if self.v_kv in (None, self.kv) else f"{self.kv}/{self.v_kv}"  # KvPair.name
        parts = [self.op.value, *([self.mode.value] if self.mode else []),
                 f"position={self.position.value}", *([f"kv={kv}"] if self.kv else []),
                 *(f"{key}={value}" for key, value in self.needs)]
        return " ".join(parts)

    @classmethod
    def of(cls, k: Kernel) -> Role:
        """What ``k`` serves (its op, position, mode and formats)."""
        return cls(k.op, k.position, k.mode, k.kv.value, v_kv=k.v_kv.value)
