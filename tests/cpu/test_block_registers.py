"""The launch contract ``block registers``: a block of ``threads`` threads is allocated
the registers ptxas gave the built kernel a thread (the manifest's resources), per
warp in the target's units, and sm_37 gives one block at most its registers per
block. A head_dim whose block would not get them is refused by the shape contract
(kgen.runtime.bind.shape_refusal: the launchers, kernel selection and the generated
kernel tests all ask it) instead of failing on the GPU with
CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES. Expected bounds are derived here from the
recorded registers and the target's fields, not written out."""

from __future__ import annotations

import pytest

from kgen import ops
from kgen.ir.axes import Mode, Op, Position
from kgen.ir.geometry import (
    block_threads,
    combine_threads,
    head_dim_step,
    query_tiles,
)
from kgen.ir.target import TARGET
from kgen.runtime import ContractError, bind
from kgen.runtime.bind import REGISTERS, shape_error, shape_refusal
from kgen.runtime.record import Built, axes_of, kernel
from kgen.runtime.select import Role, find
from kgen.testing import Case, host_args
from kgen.testing.built import BUILT, needs_build
from kgen.testing.testgen import plan_cases, register_bound

pytestmark = needs_build
NAME = "hd_q4_t8_host"  # a q4 decode whose registers bound its block below 1024 threads


def widest_block(registers: int) -> int:
    """The most threads (whole warps) a block of ``registers``-register threads may
    have: a warp takes registers x warp size, rounded up to the allocation unit."""
    unit = TARGET.register_unit
    per_warp = -(-registers * TARGET.warp // unit) * unit
    return min(TARGET.registers_per_block // per_warp * TARGET.warp, TARGET.max_threads)


@pytest.fixture(scope="module")
def records():
    import kgen_kernels

    return {name: getattr(kgen_kernels, name).kernel for name in BUILT.kernels}


def _recorded(name: str) -> int:
    return int(BUILT.kernels[name].resources["registers"])


def _served(k) -> list[int]:
    """head_dims the kernel's shape contracts accept (one group)."""
    step = head_dim_step(k) if k.op is Op.FLASH else 1
    return [hd for hd in range(step, TARGET.max_threads + 1, step)
            if shape_refusal(k, hd, 1) is None]


def test_the_launcher_record_carries_the_manifests_registers(records):
    for name, k in records.items():
        assert isinstance(k, Built) and k.registers == _recorded(name), name


def test_a_kernel_refuses_the_head_dims_its_registers_cannot_hold(records):
    k, regs = records[NAME], _recorded(NAME)
    bound = widest_block(regs)
    assert bound < 1024 <= TARGET.max_threads, f"{NAME} at {regs} registers fits 1024 threads"
    assert shape_refusal(k, 512, 1) is None
    exc = shape_error(k, 1024, 1)
    assert exc is not None and exc.contract == REGISTERS, exc
    assert f"{regs} registers a thread" in str(exc) and f"[contract: {REGISTERS}]" in str(exc)
    step = head_dim_step(k)
    at = bound // step * step  # the widest head_dim below the bound: accepted
    assert shape_refusal(k, at, 1) is None
    assert shape_error(k, at + step, 1).contract == REGISTERS
    assert register_bound(k) == (at, at + step)


def test_the_bound_follows_the_registers_recorded(records):
    """The same axes with other registers: the refused head_dims move with them; with
    none recorded (the spec's IR) only the other contracts bound the block."""
    axes = axes_of(records[NAME])
    step = head_dim_step(records[NAME])
    for regs in (32, 63, 64, 65, 72, 80, 96, 128, 255):
        k = kernel(NAME, axes, {"registers": regs})
        bound = widest_block(regs)
        for hd in range(step, TARGET.max_threads + 1, step):
            exc = shape_error(k, hd, 1)
            plain = shape_error(kernel(NAME, axes), hd, 1)
            if hd <= bound:
                assert (exc is None) == (plain is None), (regs, hd, exc)
            else:
                assert exc is not None and exc.contract == REGISTERS, (regs, hd, exc)
    assert shape_refusal(kernel(NAME, axes), 1024, 1) is None


def test_the_launcher_contract_refuses_the_launch(records):
    k = records[NAME]
    case = Case("c", n_head=4, n_head_kv=2, seq_len=20, max_seq=32, kps=16, cap=4)
    b = bind(k, host_args(k, case.with_(head_dim=512)))
    assert b.block == (block_threads(k, 512), 1, 1)
    with pytest.raises(ContractError, match=f"contract: {REGISTERS}") as exc:
        bind(k, host_args(k, case.with_(head_dim=1024)))
    assert exc.value.contract == REGISTERS


def test_kernel_selection_passes_over_a_kernel_its_registers_refuse(records):
    role = Role(Op.FLASH, Position.HOST, Mode.DECODE, kv="q4")
    pool = list(zip(records.values(), records.values(), strict=True))
    with pytest.raises(ContractError, match=REGISTERS):
        find(role, 1024, 1, variant=NAME, kernels=pool)
    assert find(role, 512, 1, variant=NAME, kernels=pool)[0].name == NAME
    try:
        k, _ = find(role, 1024, 1, kernels=pool)
    except ContractError as exc:
        assert "no kernel" in str(exc)
    else:
        assert shape_refusal(k, 1024, 1) is None


def test_no_built_kernel_accepts_a_block_its_registers_cannot_hold(records):
    """Every head_dim a built kernel's shape contracts accept gets its block's
    registers; and some kernels (NAME among them) were bounded by them."""
    bounded = []
    for name, k in records.items():
        regs = _recorded(name)
        served = _served(k)
        for hd in served:
            threads = (block_threads(k, hd) if k.op is Op.FLASH else
                       256 if k.op is Op.QZ_SPLIT else
                       ops.get(k.op).mla_threads(k) if ops.get(k.op).mla else
                       combine_threads(k, hd))
            assert threads <= widest_block(regs), (name, hd, regs)
        plain = kernel(name, axes_of(k))  # no registers: what the other contracts accept
        if k.op is Op.FLASH and not query_tiles(k) and served != _served(plain):
            bounded.append(name)
    assert NAME in bounded


def test_the_generated_tests_list_the_refused_shape_with_the_contract(records):
    """A kernel its registers bound lists the narrowest head_dim past the bound as
    refused, naming the contract; the widest below it binds."""
    seen = 0
    for name, k in records.items():
        bound = register_bound(k)
        if bound is None:
            continue
        seen += 1
        widest, past = bound
        cases, refused = plan_cases(k)
        hit = [why for c, why in refused if c == f"hd{past}_g1_block_registers"]
        assert hit and f"[contract: {REGISTERS}]" in hit[0], (name, refused)
        assert past > widest_block(_recorded(name)) >= widest
        assert shape_refusal(k, widest, 1) is None, name
        assert all(c.head_dim <= widest_block(_recorded(name)) for c in cases), name
    assert seen and register_bound(records[NAME]) is not None
