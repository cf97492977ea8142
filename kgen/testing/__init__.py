"""Harness of the kernel tests (tests/kernels/test_kernels.py, a collection over the
build's manifest).

case        the Case a test runs, and fresh random inputs (the seed goes into
            every failure message)
checks      check_kernel / check_relation: each kernel's op's GPU check (gpu, paged,
            mla, merge, dflash, dense): NaN-poisoned outputs, every element against
            the float64 NumPy reference
contracts   host_args / check_mutation: each launcher contract broken on purpose,
            refused before the GPU (so CI runs these); the ops build theirs from
            arguments
shapes      the candidate test shapes the ops name (testgen chooses among them)
paged       the paged kernels' layouts and GPU checks
keywords    what a case gives a kernel beyond its arrays (options, the format's
            scalars, sink logits), for the launcher and for the reference
device      arrays to the GPU, NaN-poisoned outputs, the comparison with the
            reference
"""

from kgen.testing.case import Case, rng
from kgen.testing.checks import check_kernel, check_relation
from kgen.testing.contracts import MUTATIONS, check_mutation, host_args, mutations_for

__all__ = ["MUTATIONS", "Case", "check_kernel", "check_mutation", "check_relation",
           "host_args", "mutations_for", "rng"]
