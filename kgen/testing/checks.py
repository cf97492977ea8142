"""Every kernel's GPU check and relation, as its op answers them (kgen.ops:
``gpu_check``, ``gpu_relation``; the checks are kgen.testing.gpu's, paged's, mla's,
merge's, dflash's and dense's): NaN-poisoned outputs, every element against the float64
NumPy reference."""

from __future__ import annotations

from kgen.ir.kernel import Kernel
from kgen.ops import get
from kgen.runtime.select import find
from kgen.testing.case import Case


def check_kernel(k: Kernel, fn, case: Case) -> None:
    """Launch ``fn`` (the generated launcher of ``k``) on ``case`` and compare."""
    return get(k.op).gpu_check(k, fn, case, find)


def check_relation(kind: str, tolerance: float, ka: Kernel, fa, kb: Kernel, fb,
                   case: Case) -> None:
    """Both kernels on the same inputs: bit-identical, or within ``tolerance`` (the
    relation ``ka``'s spec declares; its op's check)."""
    return get(ka.op).gpu_relation(kind, tolerance, ka, fa, kb, fb, case)
