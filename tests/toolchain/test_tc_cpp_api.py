"""The generated C++ host API (generated/kgen_launch.hpp, .cpp): it compiles with the
system C++ compiler against the toolkit's cuda.h, links without libcuda, and its launch
contracts answer as the Python launcher's (kgen.runtime.bind) on the same arguments.

The cases come from kgen.testing: every built kernel's test cases (kgen.testing.testgen:
both sides must accept them with the same grid, block and dynamic shared memory) and
every contract mutation of kgen.testing.contracts (both sides must refuse it with the
same contract and the same message). Mutations the C++ API cannot express are counted
and left out: a CUdeviceptr carries no dtype or strides ("array", "dtype",
"contiguous"), C++ scalars are typed ("type"); the contents of device index arrays are
not read (both sides run with validate_pos=False, where the answers must still agree).
"""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kgen.ops import params, py_args
from kgen.runtime.bind import bind
from kgen.runtime.contracts import ContractError
from kgen.runtime.record import kernel as built_kernel
from kgen.testing import MUTATIONS, host_args, mutations_for
from kgen.testing.built import BUILT
from kgen.testing.cxx import cuda_include as _cuda_include
from kgen.testing.cxx import cxx as _cxx
from kgen.testing.testgen import plan_cases

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "cpp" / "contract_cases.cpp"

pytestmark = [pytest.mark.toolchain,
              pytest.mark.skipif(BUILT is None, reason="no built kernels: run `kgen build "
                                 "specs/` (it writes generated/kgen_launch.hpp)")]


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> Path:
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler (g++, c++ or clang++ on PATH, or $CXX)")
    inc = _cuda_include()
    if inc is None:
        pytest.skip("no cuda.h (the CUDA toolkit's headers) found")
    gen = BUILT.root
    if not (gen / "kgen_launch.hpp").is_file():
        pytest.fail(f"{gen} has no kgen_launch.hpp: rebuild with `kgen build specs/`")
    out = tmp_path_factory.mktemp("cpp") / "contract_cases"
    # -I the generated tree before cuda.h's; no -lcuda: check() must not need the driver.
    cmd = [cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{gen}", f"-I{inc}",
           str(DRIVER), str(gen / "kgen_launch.cpp"), "-o", str(out), "-ldl"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr[-4000:]}"
    return out


def test_self(binary):
    done = subprocess.run([str(binary), "--self"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ---- the cases ---------------------------------------------------------------------------

UNREPRESENTABLE = object()


def _encode(k, a: dict) -> str | object:
    """A case line for the C++ driver, or UNREPRESENTABLE (what a typed C++ call cannot
    pass: a non-array, an array of another dtype or strides, a float for an int)."""
    dtypes = {p.name: p.dtype for p in params(k) if p.is_pointer}
    ints = {p.name for p in params(k) if p.ctype == "int"} | {"launch_splits",
                                                               "max_seq_len", "max_seqlen_q"}
    parts = [k.name]
    for name, v in a.items():
        if name == "validate_pos" or v is None:
            continue
        if hasattr(v, "shape") and hasattr(v, "dtype"):
            flags = getattr(v, "flags", None)
            if (name in dtypes and np.dtype(v.dtype) != np.dtype(dtypes[name])) or \
                    (flags is not None and not flags.c_contiguous):
                return UNREPRESENTABLE
            ptr = getattr(getattr(v, "data", None), "ptr", None)  # where it starts, if told
            parts.append(f"{name}=T:" + ",".join(str(int(d)) for d in v.shape)
                         + ("" if ptr is None else f"@{int(ptr):x}"))
        elif isinstance(v, bool):
            return UNREPRESENTABLE
        elif isinstance(v, int | np.integer):
            parts.append(f"{name}=I:{int(v)}")
        elif isinstance(v, float | np.floating):
            if name in ints:
                return UNREPRESENTABLE
            parts.append(f"{name}=F:{float(v)!r}")
        else:
            return UNREPRESENTABLE
    return "\t".join(parts)


def _python_answer(k, a: dict) -> str:
    a = dict(a)
    if "validate_pos" in {s.name for s in py_args(k)[1]}:
        a["validate_pos"] = False
    try:
        launch = bind(k, a)
    except ContractError as exc:
        return f"ERR\t1\t{exc.contract}\t{exc}"
    g, b = launch.grid, launch.block
    return f"OK {g[0]} {g[1]} {g[2]} {b[0]} {b[1]} {b[2]} {launch.shared_bytes}"


def _cases():
    """(label, kernel, args) for every kernel's test cases and every mutation."""
    out = []
    for name, e in BUILT.kernels.items():
        k = built_kernel(name, e.axes, e.resources)
        cases, _ = plan_cases(k)
        if not cases:
            continue
        for c in cases:
            out.append((f"{name}:{c}", k, lambda k=k, c=c: host_args(k, c)))
        for m in mutations_for(k):
            out.append((f"{name}:{m}", k, lambda k=k, c=cases[0], m=m:
                        MUTATIONS[m].make(k, c)))
    return out


def test_contracts_answer_as_python(binary, tmp_path):
    lines, expected, labels = [], [], []
    skipped: Counter = Counter()
    for label, k, make in _cases():
        a = make()
        line = _encode(k, a)
        if line is UNREPRESENTABLE:
            skipped[label.split(":")[1] if ":" in label else label] += 1
            continue
        lines.append(line)
        expected.append(_python_answer(k, a))
        labels.append(label)
    path = tmp_path / "cases.tsv"
    path.write_text("\n".join(lines) + "\n")
    done = subprocess.run([str(binary), str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = done.stdout.splitlines()
    assert len(got) == len(lines)
    wrong = [f"{lab}\n  python: {want}\n  c++:    {have}" for lab, want, have
             in zip(labels, expected, got, strict=True) if want != have]
    assert not wrong, f"{len(wrong)} of {len(lines)} cases differ:\n" + "\n".join(wrong[:20])
    refused = Counter(w.split("\t")[2] for w in expected if w.startswith("ERR"))
    # What C++ cannot express is exactly the type-level mutations (by their contract).
    type_level = {"array", "dtype", "contiguous", "type"}
    assert {MUTATIONS[name].contract for name in skipped} <= type_level, skipped
    # Every contract a mutation breaks that C++ can express is compared at least once,
    # except those that read device contents (validate_pos=False on both sides).
    device_contents = {"position", "seq_lens", "block_table", "query_start_loc",
                       "slot_mapping", "slot plan coverage", "max_seq_len", "cu_seq_lens",
                       "token_to_seq", "seq_starts", "cu_seqlens_q", "cu_seqlens_k",
                       "context_lens"}
    wanted = {m.contract for m in MUTATIONS.values()} - type_level - device_contents
    assert wanted <= set(refused), wanted - set(refused)
    print(f"{len(lines)} cases compared ({sum(refused.values())} refusals of "
          f"{len(refused)} contracts); left out: {sum(skipped.values())} ({dict(skipped)})")
