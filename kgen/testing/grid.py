"""The attention test grid, in the style of llama.cpp's test-backend-ops
FLASH_ATTN_EXT cases: head sizes, GQA ratios, KV lengths, query batch sizes,
the engine's options on and off, every KV format, dense and paged -- as data.
The full product is thousands of cases; the grid covers every value of every
axis and every pair of (format, batch, option) while rotating the rest, so one
device call runs it. Cases no generated kernel serves are filtered out by the
kernel choice itself (and reported as skips)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

HEAD_DIMS = (64, 128, 256)
GQA = (1, 4, 8)
KV_LENS = (113, 512, 1024)
Q_BATCHES = (1, 3, 32, 75)
OPTIONS = ("plain", "window", "sinks", "softcap", "all")
LAYOUTS = ("dense", "paged")


@dataclass(frozen=True)
class GridCase:
    kv: str
    head_dim: int
    gqa: int
    kv_len: int
    q_batch: int
    option: str
    layout: str

    def __str__(self) -> str:
        return (f"{self.layout}-{self.kv}-hd{self.head_dim}-gqa{self.gqa}-kv{self.kv_len}-"
                f"q{self.q_batch}-{self.option}")

    def options(self) -> dict:
        return {"plain": {}, "window": {"window_size": (37, 0)}, "sinks": {"sinks": True},
                "softcap": {"softcap": 1.5},
                "all": {"window_size": (19, 0), "attn_sink": 2, "softcap": 2.0,
                        "sinks": True}}[self.option]


def grid(formats: list[str]) -> list[GridCase]:
    """Every (format, batch, option, layout) with the other axes rotated, so each head
    size, GQA ratio and KV length appears with every format."""
    out = []
    rot = itertools.count()
    for kv, qb, opt, lay in itertools.product(formats, Q_BATCHES, OPTIONS, LAYOUTS):
        i = next(rot)
        out.append(GridCase(kv, HEAD_DIMS[i % 3], GQA[(i // 3) % 3], KV_LENS[(i // 9) % 3], qb,
                            opt, lay))
    return out
