"""A case of each public call, asked of the op that describes it (kgen.ops:
``public_calls``, ``call_args``): the first kernel of that op in the build, at the first
of its required test cases that it binds and that gives an argument set of the call.

The torch ops' tests run each call at its case: under FakeTensor and the CuPy stand-in
on the CPU (tests/cpu/test_torch_ops.py), on the GPU (tests/gpu/test_torch_ops_gpu.py).
``op`` is a kgen.torch.TorchOp; this module imports no torch itself."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np

from kgen.ir.kernel import Kernel
from kgen.ops import OPS, OpDef
from kgen.testing.case import Case
from kgen.testing.testgen import refusal, required


@dataclass(frozen=True)
class CallCase:
    """A public call's arguments (by the torch op's names: host arrays, index arrays a
    valid layout) at ``case`` over ``kernel``'s shapes, ``owner`` the op answering."""

    call: str
    owner: OpDef
    kernel: Kernel
    case: Case
    args: dict

    def __str__(self) -> str:
        return f"{self.call} at {self.kernel.name}/{self.case.name}"


def owner(call: str) -> OpDef:
    """The op whose ``public_calls`` describe ``call``."""
    (d,) = [d for d in OPS.values() if any(c.name == call for c in d.public_calls)]
    return d


def built_kernels(d: OpDef) -> list[Kernel]:
    """The op's kernels in the build, in its order."""
    import kgen_kernels

    return [k for mod in kgen_kernels.MODULES.values() for k in mod.KERNELS.values()
            if k.op is d.op]


def call_case(op) -> CallCase:
    """The first case of ``op``'s call (a kgen.torch.TorchOp) that its op's kernels give:
    every argument without a default given (an optional one as None)."""
    d = owner(op.name)
    for k in built_kernels(d):
        for case in required(k):
            got = d.call_args(op.name, k, case, np.zeros)
            if got is None or refusal(k, case) is not None:
                continue
            args = {}
            for a in op.args:
                if a.name in got:
                    args[a.name] = got[a.name]
                elif a.default is inspect.Parameter.empty:
                    if not a.type.endswith("?"):
                        break
                    args[a.name] = None
            else:
                return CallCase(op.name, d, k, case, args)
    raise AssertionError(f"no kernel of {d} in the build gives a case of {op.name}")


__all__ = ["CallCase", "built_kernels", "call_case", "owner"]
