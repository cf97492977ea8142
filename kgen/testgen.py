"""Which shapes each kernel's generated tests run, chosen from its axes.

Every candidate below is bound (kgen.runtime.bind) against the kernel at build
time and kept only if it is a legal launch, so e.g. register-K kernels get the
head_dim = 256 cases and f32 kernels also the wider ones. The coverage the
cases aim at: a partial last tile, lengths that are not multiples of 16,
chunked prefill with pos0 > 0, kv_groups 1..8, windows on and off, ragged slot
positions, long contexts, and the q4 window ring lapped by a long batch.
"""

from __future__ import annotations

from kgen.runtime.bind import bind
from kgen.runtime.contracts import ContractError
from kgen.spec.axes import KvFormat, Mode, Op, Position
from kgen.spec.ir import Kernel
from kgen.testing import Case, host_args

QZ = [
    Case("n3_h8_hd64", n=3, n_head=8, head_dim=64),
    Case("n7_h3_hd40_partial_block", n=7, n_head=3, head_dim=40),
    Case("n2_h16_hd256", n=2, n_head=16, head_dim=256),
]

APPEND = [
    Case("n5_pos3", n=5, n_head_kv=2, head_dim=256, max_seq=64, pos0=3, sink=4, win=16),
    Case("n9_ring_wrap", n=9, n_head_kv=1, head_dim=256, max_seq=32, pos0=28),
    Case("n2_hd1024", n=2, n_head_kv=1, head_dim=1024, max_seq=8, pos0=1, sink=8, win=4),
    Case("n40_window_ring_laps", n=40, n_head_kv=2, head_dim=128, max_seq=320, pos0=250,
         sink=8, win=256),
    Case("n3_no_shadows_hd64", n=3, n_head_kv=3, head_dim=64, max_seq=16, pos0=0),
]
APPEND_DEV = [
    Case("pos40", n=1, n_head_kv=2, head_dim=256, max_seq=64, positions=(40,), sink=4,
         win=16),
    Case("pos300_ring", n=1, n_head_kv=1, head_dim=128, max_seq=320, positions=(300,),
         sink=8, win=64),
    Case("pos70_wraps", n=1, n_head_kv=1, head_dim=256, max_seq=64, positions=(70,)),
]
APPEND_SLOTS = [
    Case("ragged3", n=3, n_head_kv=2, head_dim=256, max_seq=320, positions=(0, 7, 300),
         sink=8, win=32),
    Case("two_slots_hd64", n=2, n_head_kv=1, head_dim=64, max_seq=16, positions=(15, 3)),
]

PREFILL = [
    Case("g1_n5", n=5, n_head=2, n_head_kv=2, max_seq=32),
    Case("g8_n37_pos21_partial_tile", n=37, n_head=16, n_head_kv=2, max_seq=96, pos0=21,
         sink=4, win=24),
    Case("g3_n16_pos300_window", n=16, n_head=6, n_head_kv=2, max_seq=320, pos0=300,
         attn_sink=8, attn_win=64, sink=8, win=64),
    Case("g4_hd512_n20_window", n=20, n_head=8, n_head_kv=2, head_dim=512, max_seq=160,
         pos0=100, attn_sink=4, attn_win=40, sink=4, win=40),
    Case("g2_n9_pos700_long", n=9, n_head=4, n_head_kv=2, max_seq=720, pos0=700, sink=2,
         win=128),
    Case("g5_n1_pos0", n=1, n_head=5, n_head_kv=1, max_seq=16),
    Case("g2_n200_ring_floor", n=200, n_head=2, n_head_kv=1, max_seq=272, pos0=60, sink=2,
         win=100),
]

DECODE = [
    Case("g2_seq1", n_head=4, n_head_kv=2, seq_len=1, max_seq=16, kps=64, cap=8),
    Case("g8_seq17_kps8", n_head=16, n_head_kv=2, seq_len=17, max_seq=32, kps=8, cap=4,
         sink=4, win=8),
    Case("g3_seq300_window", n_head=6, n_head_kv=2, seq_len=300, max_seq=320, kps=64, cap=8,
         attn_sink=4, attn_win=50, sink=8, win=64),
    Case("g4_hd512_seq77", n_head=4, n_head_kv=1, head_dim=512, seq_len=77, max_seq=80,
         kps=16, cap=16, sink=2, win=16),
    Case("g8_seq1000_long", n_head=8, n_head_kv=1, seq_len=1000, max_seq=1024, kps=128, cap=16,
         sink=8, win=256),
]
DECODE_SLOTS = [
    Case("ragged_0_130_700", n_head=4, n_head_kv=2, max_seq=704, positions=(0, 130, 700),
         kps=64, cap=8, sink=4, win=64),
    Case("window_ragged", n_head=8, n_head_kv=1, max_seq=320, positions=(299, 16),
         kps=32, cap=16, attn_sink=4, attn_win=40, sink=4, win=40),
]
COMBINE = [
    Case("h16_s5", n_head=16, head_dim=256, n_splits=5, seq_len=300, kps=64, cap=8),
    Case("h3_s1_hd64", n_head=3, head_dim=64, n_splits=1, seq_len=10, kps=64, cap=8),
    Case("h8_s8", n_head=8, head_dim=128, n_splits=8, seq_len=1000, kps=64, cap=8),
]


def candidates(k: Kernel) -> list[Case]:
    if k.op is Op.QZ_SPLIT:
        return QZ
    if k.op is Op.KV_APPEND:
        return {Position.HOST: APPEND, Position.DEVICE: APPEND_DEV,
                Position.SLOTS: APPEND_SLOTS}[k.position]
    if k.op is Op.DECODE_COMBINE:
        return COMBINE
    if k.mode is Mode.PREFILL:
        return PREFILL
    return DECODE_SLOTS if k.position is Position.SLOTS else DECODE


def _legal(k: Kernel, case: Case) -> bool:
    try:
        bind(k, host_args(k, case))
    except ContractError:
        return False
    return True


def cases(k: Kernel) -> list[Case]:
    """The candidates that are legal launches of ``k`` (q4 kernels use the q4 fields)."""
    out = []
    for c in candidates(k):
        if k.kv is not KvFormat.Q4:
            c = c.with_(sink=0, win=0)
        if _legal(k, c):
            out.append(c)
    return out


def shared_cases(a: Kernel, b: Kernel) -> list[Case]:
    """Cases legal for both kernels of a relation."""
    names = {c.name for c in cases(b)}
    return [c for c in cases(a) if c.name in names]
