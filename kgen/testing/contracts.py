"""Contract checks on the host: a valid argument set of NumPy arrays for each
kernel, and mutations that each break one contract, so the launchers' refusals
are tested without a GPU.

Each op answers both (kgen.ops: ``contract_args``, ``contract_mutations``, built from
kgen.testing.arguments); this module asks the kernel's op and collects every op's
mutations by name."""

from __future__ import annotations

from functools import cache

import numpy as np

from kgen.ir.axes import Op
from kgen.ir.kernel import Kernel
from kgen.ops import OPS, get
from kgen.runtime.bind import bind
from kgen.runtime.contracts import ContractError
from kgen.testing.arguments import Mutation, ShapeOnly
from kgen.testing.case import Case

__all__ = ["MUTATIONS", "Mutation", "ShapeOnly", "check_mutation", "host_args",
           "mutations_for"]


def host_args(k: Kernel, case: Case, alloc=np.zeros) -> dict:
    """A valid argument set of NumPy arrays for ``bind`` (contents irrelevant);
    ``alloc(shape, dtype)`` makes each array."""
    return get(k.op).contract_args(k, case, alloc)


@cache
def op_mutations(op: Op) -> dict[str, Mutation]:
    """An op's contract mutations in order (its ``contract_mutations``, made once)."""
    return get(op).contract_mutations()


def _of_kernels_op(name: str, contract: str) -> Mutation:
    """The mutation ``name`` as the kernel's op makes it (it applies to no kernel of
    an op without it)."""
    def own(k):
        return op_mutations(k.op).get(name)
    return Mutation(contract, lambda k: own(k) is not None and own(k).applies(k),
                    lambda k, case: own(k).make(k, case))


def _every_mutation() -> dict[str, Mutation]:
    """Every op's mutations by name (a name breaks one contract, whichever op has it)."""
    out: dict[str, Mutation] = {}
    for op in OPS:
        for name, m in op_mutations(op).items():
            out.setdefault(name, _of_kernels_op(name, m.contract))
    return out


MUTATIONS: dict[str, Mutation] = _every_mutation()


def mutations_for(k: Kernel) -> list[str]:
    return [name for name, m in op_mutations(k.op).items() if m.applies(k)]


def check_mutation(k: Kernel, case: Case, mutation: str) -> None:
    """The case binds; the mutated arguments raise the mutation's contract."""
    m = MUTATIONS[mutation]
    bind(k, host_args(k, case))
    try:
        bind(k, m.make(k, case))
    except ContractError as exc:
        assert exc.contract == m.contract, f"{mutation}: expected contract {m.contract!r}, " \
                                           f"got {exc}"
        return
    raise AssertionError(f"{k.name}: {mutation} (breaks {m.contract!r}) was accepted")
