"""The Python-visible signature of each kernel's launcher.

Kernel parameters that the launcher derives from array shapes are hidden;
arrays are positional, scalars keyword-only. Generated modules and generated
tests both render from this, so they agree with ``kgen.runtime.bind``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kgen.ir.params import PARAMS

DERIVED = frozenset({"kv_groups", "head_dim", "max_seq", "n_head_kv", "total", "n_rows",
                     "block_size", "max_blocks", "num_reqs", "n_tokens", "n_head",
                     "n_slots", "kv_c_stride", "k_pe_stride", "num_blocks", "kv_splits",
                     "total_q", "num_pages"})

# Launcher scalars that are no kernel parameter: the host's bounds that size a grid.
HOST_BOUNDS = ("launch_splits", "max_seq_len", "max_seqlen_q", "max_query_len")

# The default of each parameter a caller may leave out (kgen.ir.params), as source.
DEFAULTS = {name: repr(p.default) for name, p in PARAMS.items()}


@dataclass(frozen=True)
class PyArg:
    name: str
    annotation: str
    default: str | None = None
    dtype: str | None = None  # arrays only

    @property
    def decl(self) -> str:
        d = f" = {self.default}" if self.default is not None else ""
        return f"{self.name}: {self.annotation}{d}"
