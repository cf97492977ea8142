"""What a KV-cache format is: its row layout, its rules and its NumPy model.

Everything a launcher, a check, a reference, a test or a cache object asks of
a format is a field or a method here; the code that asks never branches on a
format's name. A format is this object (``kgen/formats/<name>.py``), its
template file (``templates/kv/<name>.j2``, the macros listed in
``templates/kernels/flash.cu.j2``) and, if it needs device helpers,
``templates/lib/<name>.cuh.j2``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

FP16_SHADOW_DTYPE = np.float16  # sink rows and the recent-window ring


@dataclass(frozen=True)
class Shadow:
    """One fp16 shadow buffer: its argument name, the spec key sizing its rows and the
    role (``k`` or ``v``) whose rows it mirrors."""

    name: str
    rows_key: str  # "sink_rows" or "ring_rows" (a compile-time constant of the kernel)

    @property
    def role(self) -> str:
        return self.name[0]


# The fp16 mirrors a shadowed format keeps: the first `sink` positions and a ring of
# the last `win` positions, read instead of the (lossy) body. Order = argument order.
SHADOWS = (Shadow("k_sink", "sink_rows"), Shadow("v_sink", "sink_rows"),
           Shadow("k_win", "ring_rows"), Shadow("v_win", "ring_rows"))
SHADOW_SCALARS = ("sink", "win")
TENSOR_SCALES = ("k_scale", "v_scale")
ROLES = ("k", "v")  # a cache's two row roles: keys and values (each rows of one format)


@dataclass(frozen=True)
class KvFormat:
    name: str                   # the spec's spelling: kv = <name>
    doc: str
    ctype: str                  # C element type of a cache row (the kernels' parameters)
    dtype: str                  # NumPy dtype of those elements: the cache arrays' (the
    #                             launchers check it; kgen.ir.signature asks it here)
    block: int = 1              # head_dim must be a multiple of this (elements per block)
    block_width: int = 1        # array elements one block occupies
    shadows: bool = False       # fp16 sink rows + recent-window ring beside the body
    append_wraps: bool = True   # rows land at pos % max_seq (else pos < max_seq is required)
    append_staging: bool = False  # the append quantizer reads whole blocks: the row is
    #                               staged in shared memory, sized by max_head_dim
    register_k_lanes: int | None = None  # register K needs exactly this many dot lanes
    register_k_chunk_multiple: int = 1   # ... and kreg_max_chunk a multiple of this
    raw_v_tile: bool = False    # v_stage = shared_q4 can stage its raw V rows in shared
    fp16: bool = False          # its device code uses cuda_fp16.h
    exact_elements: bool = True  # the body holds the float32 values appended, bit for bit
    tensor_scales: bool = False  # per-tensor k_scale / v_scale kernel arguments: rows hold
    #                              x / scale, readers multiply back
    block_align: int = 1  # blocked rows: the bytes every block starts on (given a row that
    #                       does), the widest load the quad reader issues and the append's
    #                       store of a block's scale (one 16-bit store)

    # ---- layout ---------------------------------------------------------------

    @property
    def template(self) -> str:
        return f"kv/{self.name}.j2"

    @property
    def lib(self) -> str:
        return f"lib/{self.name}.cuh.j2"

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def blocked(self) -> bool:
        """Rows are whole blocks of more than one value (head_dim a multiple of ``block``)."""
        return self.block > 1

    def accepts_head_dim(self, head_dim: int) -> bool:
        return head_dim >= self.block and head_dim % self.block == 0

    def row_width(self, head_dim: int) -> int:
        """Array elements of one cache row."""
        return head_dim // self.block * self.block_width

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) * self.itemsize

    @property
    def quad_bytes(self) -> int:
        """The alignment a cache array needs for the quad reader (templates/kv/<name>.j2,
        load_key_quad: the swizzled query tile, the quads decode): four plain elements
        are one load of 4 x itemsize bytes; blocked rows are read in loads of
        block_align bytes."""
        return self.block_align if self.blocked else 4 * self.itemsize

    @property
    def store_bytes(self) -> int:
        """The alignment a cache array needs for the append's writer (the ``quant``
        helper of templates/lib/<name>.cuh.j2, else element stores): a blocked row's
        scale is one store of block_align bytes at its block's start; plain rows are
        stored element by element."""
        return self.block_align if self.blocked else self.itemsize

    def shadow_buffers(self) -> tuple[Shadow, ...]:
        return SHADOWS if self.shadows else ()

    def shadow_scalars(self) -> tuple[str, ...]:
        return SHADOW_SCALARS if self.shadows else ()

    def scale_scalars(self) -> tuple[str, ...]:
        return TENSOR_SCALES if self.tensor_scales else ()

    # ---- NumPy model: bit for bit what the append kernels write and the readers see

    def quantize_rows(self, x: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """float32 ``[..., head_dim]`` -> cache rows ``[..., row_width]`` (``scale``: the
        per-tensor scale of a format with tensor_scales; others ignore it)."""
        raise NotImplementedError

    def dequantize_rows(self, rows: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """Cache rows ``[..., row_width]`` -> the float32 values a kernel computes with."""
        raise NotImplementedError

    def round_trip_bound(self, x: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The format's error model: (target, bound) such that every element of
        ``dequantize_rows(rows)``, with ``rows = quantize_rows(x)``, lies within ``bound``
        of ``target`` (float64 arrays of x's shape; target is +-inf where the format
        overflows, x where it does not saturate). tests/cpu/test_formats.py checks it."""
        raise NotImplementedError

    def poison(self) -> object:
        """A fill value for rows nobody wrote: it decodes to NaN."""
        return np.nan if np.dtype(self.dtype).kind == "f" else 0xFF

    @classmethod
    def flags(cls) -> tuple[str, ...]:
        """The yes/no properties of a format, by name: the fields and properties typed
        ``bool`` (what ``formats where <flag>`` in a spec tests)."""
        fields = [f.name for f in dataclasses.fields(cls) if f.type == "bool"]
        props = [name for name, v in vars(KvFormat).items() if isinstance(v, property)
                 and v.fget.__annotations__.get("return") == "bool"]
        return (*fields, *props)

    @property
    def value(self) -> str:  # read like the other axes' enum values
        return self.name

    def __str__(self) -> str:
        return self.name
