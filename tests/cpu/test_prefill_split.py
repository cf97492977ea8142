"""The split query-tile prefill on the CPU (key_split = partials): every split kernel
is the twin of one whole query tile and no role reaches it by itself; the split count
follows the device (one wave of resident blocks) and is one on a K80 die; the cache
objects, over the fake CuPy, run a chunk whose tiles leave SMs idle as the split kernel
and the combine (dense and paged alike, one request splitting as the dense prefill), and
the whole kernel where the tiles fill the device or a prefill variant was named."""

from __future__ import annotations

import numpy as np
import pytest

from kgen.ir.axes import KeySplit
from kgen.ir.geometry import key_partials, prefill_grid
from kgen.ir.target import TARGET
from kgen.runtime import device
from kgen.runtime.plan import PREFILL_MAX_SPLITS, prefill_splits
from kgen.runtime.roles import ROLES
from kgen.runtime.select import Role, generated, split_twin
from kgen.testing.built import needs_build
from kgen.testing.fakecupy import FakeCupy

# An H200's multiprocessors as CUDA reports them (132 SMs, 64K registers, 228 KB).
H200 = {"multiProcessorCount": 132, "maxThreadsPerMultiProcessor": 2048,
        "maxBlocksPerMultiProcessor": 32, "regsPerMultiprocessor": 65536,
        "sharedMemPerMultiprocessor": 233472}


class WideCupy(FakeCupy):
    """The fake CuPy on a device of ``props`` (the K80 die's by default)."""

    def __init__(self, props: dict):
        super().__init__()
        base = self.cuda.runtime.getDeviceProperties(0)
        self.cuda.runtime.getDeviceProperties = staticmethod(lambda i: {**base, **props})


def _install(monkeypatch, props: dict | None = None) -> FakeCupy:
    monkeypatch.setattr(device, "_SMS", {})
    return (WideCupy(props) if props else FakeCupy()).install(monkeypatch)


def test_the_split_count_fills_one_wave_of_resident_blocks():
    """Blocks of 128 threads, 188 registers and 48 KB: two resident an SM on a K80 die
    (its 112 KB) and on an H200 (its 64K registers); 64 blocks fill a K80 die's 26
    slots, and take 4 splits to fill the H200's 264."""
    h200 = TARGET.on_device(132, 2048, 32, 65536, 233472)
    assert prefill_splits(TARGET, 64, 128, 188, 48 * 1024) == 1
    assert prefill_splits(h200, 64, 128, 188, 48 * 1024) == 4
    assert prefill_splits(h200, 264, 128, 188, 48 * 1024) == 1
    assert prefill_splits(h200, 1, 128, 188, 48 * 1024) == PREFILL_MAX_SPLITS
    with pytest.raises(ValueError):
        prefill_splits(h200, 0, 128, 188, 48 * 1024)


@needs_build
def test_every_split_kernel_is_the_twin_of_one_whole_query_tile():
    pool = generated()
    split = [k for k, _ in pool if key_partials(k)]
    assert split, "no split prefill generated"
    twins = {}
    for k, _ in pool:
        t = split_twin(k, pool)
        if t is not None:
            assert t[0].key_split is KeySplit.PARTIALS and t[0].position is k.position
            assert (t[0].kv, t[0].mask, t[0].tile_rows, t[0].max_head_dim) == \
                (k.kv, k.mask, k.tile_rows, k.max_head_dim)
            twins[t[0].name] = k.name
    assert sorted(twins) == sorted(k.name for k in split)
    for k in split:  # no role reaches a split kernel by itself
        assert split_twin(k, pool) is None
        assert not any(Role(r.op, r.position, r.mode, k.kv.value).matches(k)
                       for r in ROLES.values())


def _chunk(cp, kv="f16", hd=128, n_kv=8, G=4, rows=128, ctx=3968, **kw):
    from kgen.runtime.kv import KVCache

    cache = KVCache(n_kv, hd, ctx + rows, kv=kv, **kw)
    q = cp.empty((rows, n_kv * G, hd))
    kn, vn = cp.empty((rows, n_kv, hd)), cp.empty((rows, n_kv, hd))
    n0 = len(cp.launched)
    cache.prefill(q, kn, vn, pos0=ctx)
    return cache, cp.launched[n0:]


@needs_build
@pytest.mark.parametrize("kv", ["f16", "f32", "q8_0"])
def test_a_chunk_that_leaves_sms_idle_runs_split_and_combined(monkeypatch, kv):
    """128 rows after 3968 keys at 32/8 heads: 8 query tiles x 8 kv heads = 64 blocks.
    On the H200's 132 SMs the chunk runs as 4 key splits (grid x 8 * 4) and the combine
    over its 128 * 32 (row, q head) heads; the paged cache splits one request alike
    (for f32 and q8_0 too, whose paged split forms load each tile in place: the twin and
    the plan ignore where a tile's loads are issued)."""
    from kgen.runtime.paged import PagedKVCache

    cp = _install(monkeypatch, H200)
    cache, launched = _chunk(cp, kv=kv)
    names = [n for n, *_ in launched]
    assert cache.last_prefill_splits == 4 and cache.last_prefill_split == names[-2], names
    split = next(k for k, _ in generated() if k.name == names[-2])
    assert key_partials(split) and split.kv.value == kv
    assert names[-1] == cache.kernels.get("combine")[0].name, names
    assert launched[-2][1] == (8 * 4, 8, 1) and launched[-1][1][0] == 128 * 32, launched[-2:]

    paged = PagedKVCache(8 * 65, 64, 8, 128, kv=kv)
    sid = paged.add()
    q = cp.empty((4096, 32, 128))
    paged.prefill([sid], q, cp.empty((4096, 8, 128)), cp.empty((4096, 8, 128)), [3968 + 128])
    assert paged.last_prefill_splits == 1  # 4096 rows: 2048 blocks fill the device
    paged2 = PagedKVCache(8 * 65, 64, 8, 128, kv=kv)
    sid = paged2.add()
    paged2.prefill([sid], cp.empty((3968, 32, 128)), cp.empty((3968, 8, 128)),
                   cp.empty((3968, 8, 128)), [3968])
    n0 = len(cp.launched)
    paged2.prefill([sid], cp.empty((128, 32, 128)), cp.empty((128, 8, 128)),
                   cp.empty((128, 8, 128)), [128])
    got = cp.launched[n0:]
    assert paged2.last_prefill_splits == 4 and got[-2][1] == (8 * 4, 8, 1), got[-2:]
    assert paged2.last_prefill_split == "paged_" + cache.last_prefill_split


@needs_build
def test_the_k80_die_and_a_filled_device_run_the_whole_kernel(monkeypatch):
    cp = _install(monkeypatch)  # the fake CuPy's K80 die: 64 blocks fill it
    cache, launched = _chunk(cp)
    assert cache.last_prefill_splits == 1 and cache.last_prefill_split is None
    kp = next(k for k, _ in generated() if k.name == cache.last_prefill)
    assert launched[-1][1] == prefill_grid(kp, 128, 4, 8)

    cp = _install(monkeypatch, H200)
    cache, _ = _chunk(cp, rows=1024, ctx=0)  # 64 tiles x 8 kv heads: 512 blocks
    assert cache.last_prefill_splits == 1


@needs_build
def test_a_named_prefill_variant_runs_as_named(monkeypatch):
    cp = _install(monkeypatch, H200)
    base, _ = _chunk(cp)
    whole = base.last_prefill
    assert base.last_prefill_split == split_twin(
        next(k for k, _ in generated() if k.name == whole), generated())[0].name
    cache, launched = _chunk(cp, variants={"prefill": whole})
    assert cache.last_prefill == whole and cache.last_prefill_splits == 1
    assert launched[-1][0] == whole


@needs_build
def test_neutral_options_split_as_the_plain_call(monkeypatch):
    """A chunk with an exact window, soft-cap and sinks runs the options' split twin
    (split 0 folds the sinks: the plain combine), split as the plain chunk: the split
    plan weighs one register count for both."""
    cp = _install(monkeypatch, H200)
    for hd in (64, 128, 256):
        plain, _ = _chunk(cp, hd=hd)
        from kgen.runtime.kv import INT_MAX, KVCache

        cache = KVCache(8, hd, 4096, kv="f16")
        n0 = len(cp.launched)
        cache.prefill(cp.empty((128, 32, hd)), cp.empty((128, 8, hd)), cp.empty((128, 8, hd)),
                      pos0=3968, window_size=(INT_MAX, 0), softcap=0.0, sinks=cp.empty((32,)))
        got = cp.launched[n0:]
        assert cache.last_prefill_splits == plain.last_prefill_splits > 1, hd
        assert cache.last_prefill_split == plain.last_prefill_split + "_opts"
        assert got[-1][0] == plain.kernels.get("combine")[0].name


@needs_build
def test_partials_too_small_are_refused_before_the_launch(monkeypatch):
    """The split kernel's contracts: partials for rows x n_head x n_splits heads."""
    from kgen.runtime.contracts import ContractError

    cp = _install(monkeypatch, H200)
    k, fn = next((k, f) for k, f in generated() if key_partials(k) and k.kv.value == "f32"
                 and k.position.value == "host" and k.max_head_dim == 128)
    q = cp.empty((16, 8, 128))
    kc = cp.empty((2, 64, 128))
    small = cp.empty((16 * 8 * 3 - 1,))
    n0 = len(cp.launched)
    with pytest.raises(ContractError, match="partials size"):
        fn(q, kc, kc, small, cp.empty((16 * 8 * 3,)), cp.empty((16 * 8 * 3 * 128,)),
           pos0=0, n_splits=3)
    with pytest.raises(ContractError, match="n_splits"):
        fn(q, kc, kc, *(cp.empty((n,)) for n in (384, 384, 384 * 128)), pos0=0, n_splits=0)
    assert len(cp.launched) == n0
    fn(q, kc, kc, *(cp.empty((n,)) for n in (384, 384, 384 * 128)), pos0=0, n_splits=3)
    assert cp.launched[-1][1] == (-(-16 * 4 // k.tile_rows) * 3, 2, 1)
    np.testing.assert_equal(len(cp.launched), n0 + 1)


@needs_build
def test_no_rows_plan_no_split(monkeypatch):
    """A prefill of no rows: the dense cache appends and launches nothing and returns an
    empty out; the paged one refuses as before (no query rows), the plan asked nothing."""
    from kgen.runtime.contracts import ContractError
    from kgen.runtime.kv import KVCache
    from kgen.runtime.paged import PagedKVCache

    cp = _install(monkeypatch, H200)
    c = KVCache(2, 128, 160, kv="f16")
    n0 = len(cp.launched)
    out = c.prefill(cp.empty((0, 8, 128)), cp.empty((0, 2, 128)), cp.empty((0, 2, 128)), 0)
    assert out.shape == (0, 8, 128) and len(cp.launched) == n0
    assert c.last_prefill_splits == 1 and c.last_prefill_split is None
    p = PagedKVCache(16, 16, 2, 128, kv="f16")
    sid = p.add()
    with pytest.raises(ContractError, match="no query rows"):
        p.prefill([sid], cp.empty((0, 8, 128)), cp.empty((0, 2, 128)), cp.empty((0, 2, 128)),
                  [0])
    assert len(cp.launched) == n0


@needs_build
def test_a_split_forms_dense_paged_and_option_siblings_plan_alike():
    """The split plan weighs the most registers of a family that ignores the position,
    the options and prefetch: every split form of one arithmetic (dense or paged, with
    or without the options, loading a tile ahead or in place) weighs the same registers,
    so each splits as the others on any device (the same bits)."""
    from kgen.runtime.plan import split_family_registers, split_registers
    from kgen.runtime.record import axes_of

    pool = [k for k, _ in generated() if key_partials(k)]
    table = split_family_registers(pool)
    groups: dict[tuple, set[int]] = {}
    for k in pool:
        axes = axes_of(k)
        for key in ("position", "doc", "module", "window", "softcap", "sinks", "prefetch"):
            axes.pop(key)
        groups.setdefault(tuple(sorted(axes.items())), set()).add(split_registers(k, table))
    assert any(len({x.prefetch for x in pool if x.kv is k.kv}) > 1 for k in pool)
    assert all(len(regs) == 1 for regs in groups.values()), groups
