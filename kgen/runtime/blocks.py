"""Paged block bookkeeping shared by the paged cache objects (kgen.runtime.paged's
PagedKVCache, kgen.runtime.mla's MLACache): sequences, each with a block table over
pages of ``block_size`` positions taken from a free list on the host, and their
lengths. Every method checks its arguments before it changes anything; a refusal is
a ContractError naming the cache class (``WHO``)."""

from __future__ import annotations

import numpy as np

from kgen.ir.params import INT_MAX
from kgen.runtime.contracts import ContractError
from kgen.runtime.options import count, is_int, positive

_UNASKED = object()  # _batch's rows where the call takes none


def _listed(x) -> bool:
    return isinstance(x, list | tuple) or (isinstance(x, np.ndarray) and x.ndim == 1)


class PagedBlocks:
    WHO = "PagedBlocks"  # how refusals name the cache (each subclass sets its own)

    def _init_blocks(self, num_blocks: int, block_size: int,
                     max_blocks_per_seq: int | None) -> None:
        """Check and keep the page geometry; every block free, no sequence. A sequence
        holds at most every block: max_blocks_per_seq (None: num_blocks) is at most
        num_blocks."""
        self.num_blocks = positive("num_blocks", num_blocks, self.WHO)
        self.block_size = positive("block_size", block_size, self.WHO)
        self.max_blocks = positive("max_blocks_per_seq", num_blocks if max_blocks_per_seq
                                   is None else max_blocks_per_seq, self.WHO)
        if self.max_blocks > self.num_blocks:
            raise ContractError(self.WHO, "max_blocks_per_seq", f"max_blocks_per_seq = "
                                f"{self.max_blocks} exceeds num_blocks = {self.num_blocks} (a "
                                "sequence holds at most every block)")
        if num_blocks * block_size > INT_MAX:
            raise ContractError(self.WHO, "range", "positions overflow int32")

    def _reset_blocks(self) -> None:
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._next = 0

    # ---- sequences ---------------------------------------------------------------

    def add(self) -> int:
        """A new, empty sequence; returns its id."""
        sid = self._next
        self._next += 1
        self.tables[sid], self.lengths[sid] = [], 0
        return sid

    def free(self, sid: int) -> None:
        """Give a sequence's blocks back."""
        self._known(sid)
        self.free_blocks.extend(reversed(self.tables.pop(sid)))
        del self.lengths[sid]

    def _known(self, sid) -> None:
        if not is_int(sid) or sid not in self.tables:
            raise ContractError(self.WHO, "sequence", f"no sequence {sid!r}")

    def _batch(self, sids, rows=_UNASKED, name: str = "rows") -> list[int] | None:
        """``sids``: known sequences, each once; ``rows`` (where the call takes them, even
        as None): a count >= 0 per sequence (``name``: the call's word for them). Returns
        the counts as ints (None where not asked)."""
        if not _listed(sids) or len(sids) == 0:
            raise ContractError(self.WHO, "sequence", "sids must be a non-empty list of sequence "
                                f"ids, not {sids!r}")
        for sid in sids:
            self._known(sid)
        if len(set(sids)) != len(sids):
            raise ContractError(self.WHO, "sequence", f"each sequence once, not {list(sids)}")
        if rows is _UNASKED:
            return None
        if not _listed(rows) or len(rows) != len(sids):
            raise ContractError(self.WHO, "sequence", f"{name} must list one count per "
                                f"sequence ({len(sids)}), not {rows!r}")
        return [count(f"{name}[{i}]", n, 0, self.WHO) for i, n in enumerate(rows)]

    def _grown(self, sids: list[int], rows: list[int]) -> dict[int, list[int]]:
        """Each sequence's block table once it holds ``rows`` more positions, blocks
        taken from the free list as ``pop`` would; refused (nothing changes) when a
        sequence would exceed max_blocks_per_seq or the free blocks run out."""
        need = {}
        for sid, n in zip(sids, rows, strict=True):
            blocks = -(-(self.lengths[sid] + n) // self.block_size)
            if blocks > self.max_blocks:
                raise ContractError(self.WHO, "max_blocks_per_seq", f"sequence {sid} "
                                    f"would need {blocks} blocks (at most {self.max_blocks})")
            need[sid] = max(blocks - len(self.tables[sid]), 0)
        if sum(need.values()) > len(self.free_blocks):
            raise ContractError(self.WHO, "out of blocks", f"needs {sum(need.values())} "
                                f"more blocks, {len(self.free_blocks)} free")
        taken = reversed(self.free_blocks)
        return {sid: self.tables[sid] + [next(taken) for _ in range(n)]
                for sid, n in need.items()}

    def _commit(self, sids: list[int], rows: list[int], tables: dict[int, list[int]]) -> None:
        """Take the blocks ``_grown`` planned and advance the lengths."""
        used = sum(len(t) - len(self.tables[sid]) for sid, t in tables.items())
        del self.free_blocks[len(self.free_blocks) - used:]
        self.tables.update(tables)
        for sid, n in zip(sids, rows, strict=True):
            self.lengths[sid] += n

    def block_table(self, sids: list[int]) -> np.ndarray:
        """int32 [len(sids)][max_blocks]: each sequence's physical blocks (0-padded)."""
        self._batch(sids)
        return self._block_table([self.tables[sid] for sid in sids])

    def _block_table(self, tables: list[list[int]]) -> np.ndarray:
        out = np.zeros((len(tables), self.max_blocks), np.int32)
        for i, t in enumerate(tables):
            out[i, : len(t)] = t
        return out

    def slot_mapping(self, sid: int, positions: range) -> np.ndarray:
        """int32: the physical slot of each position of sequence ``sid`` (positions
        within the blocks it holds)."""
        self._known(sid)
        held = len(self.tables[sid]) * self.block_size
        if not isinstance(positions, range) or (len(positions) and (
                min(positions) < 0 or max(positions) >= held)):
            raise ContractError(self.WHO, "range", f"positions must be a range within the "
                                f"{held} positions sequence {sid} holds blocks for, not "
                                f"{positions!r}")
        return self._slots(self.tables[sid], positions)

    def _slots(self, table: list[int], positions: range) -> np.ndarray:
        bs = self.block_size
        return np.array([table[p // bs] * bs + p % bs for p in positions], np.int32)
