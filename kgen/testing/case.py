"""One launch shape for the kernel tests, and their random inputs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import numpy as np

from kgen.ir.params import NO_WINDOW, PARAMS


@dataclass(frozen=True)
class Case:
    """One launch shape. Unused fields are ignored by ops that do not read them."""

    name: str
    n: int = 1                 # query/append rows (prefill, append), slots or merge tokens
    n_head: int = 8
    n_head_kv: int = 2
    head_dim: int = 256
    max_seq: int = 64
    pos0: int = 0              # first position of the batch (prefill/append)
    seq_len: int = 1           # decode context length (host and device position)
    positions: tuple[int, ...] = ()  # per-slot positions (slots kernels)
    sink: int = 0              # fp16 sink rows written/read (shadowed formats)
    win: int = 0               # fp16 window rows (shadowed formats)
    attn_sink: int = 0
    attn_win: int = 0          # tile-granular recent window (window = sink_recent)
    win_left: int | None = None   # key-exact window (window = exact); None: unbounded
    win_right: int | None = None
    softcap: float = 0.0       # softcap = tanh kernels; 0 is off
    sinks: bool = False        # sinks = learned kernels: random sink logits (else -inf)
    requests: tuple[tuple[int, int], ...] = ()  # paged: (query rows, keys) per request;
    #                                              dflash: (block rows, context rows)
    block_size: int = 16       # paged: positions per page
    k_scale: float = 1.0       # per-tensor scales (formats with tensor_scales)
    v_scale: float = 1.0
    kps: int = 64
    cap: int = 8
    n_splits: int = 3          # combine only
    prefill_tokens_with_context: int = -1  # merge: tokens from here on take the suffix
    lse_pattern: str = "random"  # merge: the LSEs (kgen.testing.gpu.MERGE_LSE_PATTERNS)
    slots: int = 0             # concat_and_cache_mla: slot_mapping entries (0: one a token)
    row_pad: int = 0           # concat_and_cache_mla: source rows this many elements apart
    #                            beyond their width (the GPU check's strided sources)
    seq_starts: tuple[int, ...] = ()  # gather_mla_cache: each request's first row
    causal: bool = False       # dflash: causal within the block (else bidirectional)
    sliding_window: int = 0    # dflash, causal: the window (<= 0: plain causal)
    pad_rows: int = 0          # dflash: query rows past the last request (zeros out)
    extra: dict = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        return self.name

    def with_(self, **kw) -> Case:
        return replace(self, **kw)

    def neutral(self) -> Case:
        """The case with every optional feature off (what a relation between a kernel
        with the feature and one without compares)."""
        return replace(self, win_left=None, win_right=None, softcap=PARAMS["softcap"].neutral,
                       sinks=False, attn_sink=PARAMS["attn_sink"].neutral,
                       attn_win=PARAMS["attn_win"].neutral)

    @property
    def window(self) -> tuple[int, int] | None:
        """The exact window as the reference takes it (None: unbounded)."""
        if self.win_left is None and self.win_right is None:
            return None
        left, right = NO_WINDOW
        return (left if self.win_left is None else self.win_left,
                right if self.win_right is None else self.win_right)


def rng() -> tuple[np.random.Generator, int]:
    """A generator and its seed: fresh each time, or KGEN_TEST_SEED to replay a failure
    (every failure message names the seed)."""
    env = os.environ.get("KGEN_TEST_SEED")
    seed = int(env) if env else int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def normal(r: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    """float32 normal samples (scaled)."""
    return (r.standard_normal(shape) * scale).astype(np.float32)


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as float32 bit patterns, except any NaN matches any NaN."""
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    na, nb = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(na, nb)
                and np.array_equal(a.view(np.uint32)[~na], b.view(np.uint32)[~nb]))




def random_bits(g: np.random.Generator, a: np.ndarray) -> np.ndarray:
    """Random bytes shaped and typed as ``a`` (old cache contents of a format stored as
    integers: every bit pattern, not the few a cast of small floats gives)."""
    return g.integers(0, 256, a.nbytes, dtype=np.uint8).view(a.dtype).reshape(a.shape)
