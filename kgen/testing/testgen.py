"""Which shapes each kernel's tests run, chosen from its axes.

Every kernel gets the shapes :func:`required` derives from its axes (its
smallest legal head_dim, with one group and with its largest group count, over
a partial last tile), then the candidates its op names (kgen.ops: ``case_required``,
``case_candidates``; the tables are kgen.testing.shapes'). Each is bound
(kgen.runtime.bind) against the kernel; a candidate it refuses is retried at its
smallest head_dim (a query_tile kernel: its widest), and one still refused is listed
with the contract it breaks among the kernel tests (skipped, with the reason). The
coverage the candidates aim at: partial last tiles, lengths off the tile grid,
chunked prefill with pos0 > 0, many group counts, windows on and off, ragged slot
positions, long contexts, an fp16 window ring lapped by a long batch, and for
query_tile batches that are no whole number of query tiles. Where the registers
ptxas gave a kernel (its build record) bound its block below the head_dims its
other contracts accept, the narrowest head_dim past the bound is listed as refused
(:func:`register_bound`).
"""

from __future__ import annotations

from kgen.errors import SpecError
from kgen.ir.geometry import head_dim_step, query_tiles
from kgen.ir.kernel import Kernel
from kgen.ir.target import TARGET
from kgen.ops import get, params
from kgen.runtime.bind import REGISTERS, bind, shape_error
from kgen.runtime.contracts import ContractError
from kgen.testing import Case, host_args
from kgen.testing.shapes import MODEL_HEAD_DIMS, flash_case

__all__ = ["MODEL_HEAD_DIMS", "candidates", "cases", "contract_class", "plan_cases",
           "register_bound", "required", "retry_head_dim", "shared_cases",
           "smallest_head_dim"]


def candidates(k: Kernel) -> list[Case]:
    """The candidate shapes of ``k``'s tests (its op's, kgen.testing.shapes)."""
    return get(k.op).case_candidates(k)


def smallest_head_dim(k: Kernel) -> int:
    """The smallest head_dim ``k`` launches with (from its axes and its format)."""
    return get(k.op).case_smallest_head_dim(k)


def retry_head_dim(k: Kernel) -> int:
    """The head_dim a candidate the kernel refuses is retried at: its smallest, or for
    a query_tile kernel (which takes every head_dim up to max_head_dim) its widest, so
    every thread's whole output patch is in use."""
    return k.max_head_dim if query_tiles(k) else smallest_head_dim(k)


def required(k: Kernel) -> list[Case]:
    """Shapes every kernel is tested at, derived from its axes: its smallest head_dim
    with one group and with its largest group count, each over a partial last tile."""
    return get(k.op).case_required(k)


def register_bound(k: Kernel) -> tuple[int | None, int] | None:
    """Where the registers ptxas gave ``k`` (its build record) bound its head_dim
    below what its other contracts accept: (the widest head_dim it launches below the
    bound, or None; the narrowest its block registers refuse), or None where they
    bound nothing. A kernel of an op whose block grows with head_dim only (its
    ``case_registers_bound``)."""
    if not get(k.op).case_registers_bound(k):
        return None
    step = head_dim_step(k)
    widest = None
    for hd in range(step, TARGET.max_threads + 1, step):
        exc = shape_error(k, hd, 1)
        if exc is None:
            widest = hd
        elif exc.contract == REGISTERS:
            return widest, hd
    return None


def _register_case(k: Kernel) -> list[Case]:
    """The narrowest launch past ``k``'s register bound (listed as refused, with the
    contract: block registers), if its registers bound it. The widest launch below
    the bound is not made a GPU case: off a K80 the driver JIT-compiles the PTX with
    registers of its own, which the manifest's sm_37 count does not bound."""
    bound = register_bound(k)
    if bound is None:
        return []
    return [flash_case(k, bound[1], 1, f"hd{bound[1]}_g1_block_registers")]


def refusal(k: Kernel, case: Case) -> str | None:
    """Why ``k`` refuses ``case`` (the contract's message), or None if it binds."""
    try:
        bind(k, host_args(k, case))
    except ContractError as exc:
        return str(exc)
    return None


def _fit(k: Kernel, c: Case) -> Case:
    """The candidate as this kernel's format reads it: no shadow rows without shadows,
    and no more sink or window rows than the kernel keeps (small rings are tested with
    the most they hold); per-tensor scales that are not 1 (and, on the long cases,
    small enough that some values saturate), where the format has them."""
    if not k.pair.shadows:
        c = c.with_(sink=0, win=0)
    else:
        c = c.with_(sink=min(c.sink, k.sink_rows), win=min(c.win, k.ring_rows))
    if k.pair.tensor_scales:
        c = c.with_(k_scale=0.5, v_scale=0.25) if c.max_seq < 512 else \
            c.with_(k_scale=0.005, v_scale=2.0)
    return c


def plan_cases(k: Kernel) -> tuple[list[Case], list[tuple[str, str]]]:
    """(the cases ``k`` is tested at, the candidates it refuses with the reason).

    A candidate written for the common head_dim is retried at the kernel's
    smallest head_dim (query_tile: its widest) before it counts as refused; refused
    candidates are listed
    among the kernel tests (skipped, with the reason), never dropped silently. Where
    the registers ptxas gave the kernel bound its block below the head_dims its other
    contracts accept, the narrowest head_dim past the bound is listed as refused
    (block registers)."""
    out: list[Case] = []
    refused: list[tuple[str, str]] = []
    seen: set[str] = set()
    past = _register_case(k)
    as_is = {c.name for c in past}  # past the register bound: not retried narrower
    for c in [*required(k), *candidates(k), *past]:
        c = _fit(k, c)
        why = refusal(k, c)
        if why is not None and get(k.op).case_retries_refused and \
                c.head_dim != retry_head_dim(k) and \
                c.name not in as_is:
            alt = c.with_(name=f"{c.name}_hd{retry_head_dim(k)}", head_dim=retry_head_dim(k))
            if refusal(k, alt) is None:
                c, why = alt, None
        if why is not None:
            refused.append((c.name, why))
        elif c.name not in seen:
            seen.add(c.name)
            out.append(c)
    return out, refused


def cases(k: Kernel) -> list[Case]:
    """The legal cases of ``k``; a kernel with none is a spec error (no empty test)."""
    out, refused = plan_cases(k)
    if not out:
        reasons = "; ".join(f"{n}: {why}" for n, why in refused[:3])
        raise SpecError(k.pos, f"'{k.name}' refuses every test shape kgen derives for it "
                        f"({reasons}): the kernel has no legal launch to test")
    return out


def _common(a: Kernel, b: Kernel, c: Case) -> Case:
    """``c`` with the options only one of the two kernels has switched off: a
    relation compares the kernels where they mean the same thing."""
    if a.window is not b.window:
        c = c.with_(win_left=None, win_right=None, attn_sink=0, attn_win=0)
    if a.softcap is not b.softcap:
        c = c.with_(softcap=0.0)
    if a.sinks is not b.sinks:
        c = c.with_(sinks=False)
    return c


def shared_cases(a: Kernel, b: Kernel) -> list[Case]:
    """Cases of ``a`` that ``b`` also launches (the relation compares them), with
    the options only one of them has switched off; duplicates dropped."""
    out: list[Case] = []
    for c in cases(a):
        c = _common(a, b, c)
        same = any(c.with_(name="") == o.with_(name="") for o in out)
        if not same and refusal(b, c) is None:
            out.append(c)
    return out


def contract_class(k: Kernel) -> tuple:
    """Kernels whose launch contracts are the same checks: the same parameters, and the
    same op, position, format and options (what decides which arguments a launcher
    takes and the rules on each) and the same schedule (whose block geometry decides
    the shape rules). Tile shapes and staging change only the numbers the shared
    formulas give, so a contract is refused once per class, by the first kernel of the
    class it applies to."""
    return (tuple((p.name, p.ctype) for p in params(k)), k.op, k.mode, k.position, k.kv, k.v_kv,
            k.window, k.mask, k.softcap, k.sinks, k.ring_floor, k.schedule)
