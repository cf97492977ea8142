"""The one table from spec enums to CUDA spellings the templates emit."""

from __future__ import annotations

from kgen.ir.axes import KStage, QStage

# Element type of a staged tile, per staging choice.
Q_ELEM = {QStage.F32: "float", QStage.F16: "__half"}
K_TILE_ELEM = {KStage.SHARED_F32: "float", KStage.SHARED_F16: "__half", KStage.REGISTERS: None}

# Value conversion between element types: (from, to) -> format string.
CONVERT = {
    ("float", "float"): "{}",
    ("__half", "__half"): "{}",
    ("__half", "float"): "__half2float({})",
    ("float", "__half"): "__float2half({})",
}

# Extern shared symbol per layout. The name is part of the PTX (the kernels
# address the dynamic shared window through it), so it is fixed per layout.
SHARED_SYMBOL = {
    # (byte_addressed, has_k_tile, has_v_tile)
    (False, True, False): "sh",
    (False, False, False): "shk",
    (False, False, True): "shv",
    (False, True, True): "shkv",
    (True, True, False): "shb",
    (True, False, False): "shb",
    (True, False, True): "shb",
    (True, True, True): "shb",
}

NEG_INF = "-__int_as_float(0x7f800000)"


def convert(expr: str, src: str, dst: str) -> str:
    return CONVERT[(src, dst)].format(expr)
