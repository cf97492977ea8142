"""Every built kernel's tests, collected from the build's manifest (nothing here names a
kernel): correctness against the float64 NumPy reference at each case kgen derives from
the kernel's axes (GPU), every relation its spec declares (GPU), and every launch contract
its launcher enforces, refused before the GPU (host only, so CI runs them; once per
contract class, kgen.testing.testgen.contract_class). The cases come from
kgen.testing.testgen, the checks from kgen.testing."""

from __future__ import annotations

import pytest

from kgen.testing import check_kernel, check_mutation, check_relation, mutations_for
from kgen.testing.built import BUILT
from kgen.testing.testgen import contract_class, plan_cases, shared_cases

if BUILT is not None:
    import kgen_kernels

    LAUNCHERS = {name: getattr(kgen_kernels, name) for name in BUILT.kernels}
else:
    LAUNCHERS = {}
RECORDS = {name: fn.kernel for name, fn in LAUNCHERS.items()}
CASES = {name: plan_cases(k)[0] for name, k in RECORDS.items()}
NO_BUILD = "no built kernels: run `kgen build specs/` (or install a kgen wheel)"


def _kernel_params():
    """Each kernel's cases; a candidate shape it refuses is listed as skipped, with why."""
    out = []
    for name, k in RECORDS.items():
        cases, refused = plan_cases(k)
        out += [pytest.param(name, c, id=f"{name}-{c}") for c in cases]
        out += [pytest.param(name, None, id=f"{name}-{c}", marks=pytest.mark.skip(
            reason=f"{name} refuses the candidate shape {c}: {why}")) for c, why in refused]
    return out


def _relation_params():
    out = []
    for name, e in (BUILT.kernels.items() if BUILT else ()):
        for r in e.relations:
            other = r["other"]
            marks = () if other in RECORDS else pytest.mark.skip(
                reason=f"{other} is not in this build")
            cases = shared_cases(RECORDS[name], RECORDS[other]) if other in RECORDS else [None]
            out += [pytest.param(name, r["kind"], r["tolerance"], other, c, marks=marks,
                                 id=f"{name}-{r['kind']}-{other}-{c}") for c in cases]
    return out


def _refusal_params():
    """(kernel, mutation): each mutation once per contract class, by the first kernel of
    the class (in build order) it applies to."""
    first: dict = {}
    for name, k in RECORDS.items():
        if CASES[name]:
            for m in mutations_for(k):
                first.setdefault((contract_class(k), m), name)
    return [pytest.param(name, m, id=f"{name}-{m}") for (_, m), name in first.items()]


@pytest.mark.skipif(BUILT is None, reason=NO_BUILD)
@pytest.mark.parametrize("name", list(RECORDS))
def test_every_kernel_has_a_case(name):
    """A kernel kgen can derive no legal test launch for is untested: a failure."""
    cases, refused = plan_cases(RECORDS[name])
    assert cases, f"{name} refuses every test shape kgen derives for it: " + "; ".join(
        f"{n}: {why}" for n, why in refused[:3])


@pytest.mark.gpu
@pytest.mark.parametrize("name, case", _kernel_params())
def test_kernel(name, case):
    check_kernel(RECORDS[name], LAUNCHERS[name], case)


@pytest.mark.gpu
@pytest.mark.parametrize("name, kind, tolerance, other, case", _relation_params())
def test_relation(name, kind, tolerance, other, case):
    check_relation(kind, tolerance, RECORDS[name], LAUNCHERS[name], RECORDS[other],
                   LAUNCHERS[other], case)


@pytest.mark.parametrize("name, mutation", _refusal_params())
def test_refuses(name, mutation):
    check_mutation(RECORDS[name], CASES[name][0], mutation)


@pytest.mark.skipif(BUILT is None, reason=NO_BUILD)
def test_the_collection_covers_the_build():
    """Every kernel of the build has cases, every relation is collected, and every
    contract class is refused by one of its kernels."""
    assert set(RECORDS) == set(BUILT.kernels)
    relations = sum(len(e.relations) for e in BUILT.kernels.values())
    assert len({p.values[:4] for p in _relation_params()}) == relations
    refused = {(contract_class(RECORDS[p.values[0]]), p.values[1]) for p in _refusal_params()}
    assert refused == {(contract_class(k), m) for n, k in RECORDS.items() if CASES[n]
                       for m in mutations_for(k)}
