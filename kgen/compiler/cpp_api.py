"""The C++ host API (generated/kgen_launch.hpp, kgen_launch.cpp): per kernel, its
argument struct, its launch contracts and geometry, and a launch through the CUDA
driver API (templates/c/kgen_launch.*.j2).

What the C++ side needs of a kernel is asked here of the same Python sources the
runtime asks: the parameter list (``kgen.ir.signature.params``), the launcher's
arguments (``kgen.ir.pyapi.py_args``), the optional scalars (``kgen.ir.params``),
the target's limits (``kgen.ir.target``) and the geometry (``kgen.ir.geometry``).
The geometry functions are not ported: each is *evaluated* with symbolic
arguments (:class:`Sym`), so the C++ expression of a kernel's block size, shared
memory, cache row width and prefill grid is the Python function's own arithmetic.
The contract rules themselves (``kgen.runtime.bind``) are Python control flow; they
are ported once, by hand, into the template's ``detail`` namespace, in the same
order with the same contract names and messages (tests/toolchain/test_tc_cpp_api.py
compares both answers on every mutation of ``kgen.testing.contracts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kgen import __version__
from kgen.formats.base import SHADOW_SCALARS, SHADOWS, TENSOR_SCALES
from kgen.ir import geometry as geo
from kgen.ir.axes import (
    IoDtype,
    KStage,
    Lse,
    Op,
    Position,
    Sinks,
    SoftCap,
    VStage,
    Window,
)
from kgen.ir.params import INT_MAX, PARAMS
from kgen.ir.pyapi import HOST_BOUNDS
from kgen.ir.target import TARGET
from kgen.ops import OPS, get, params, py_args
from kgen.runtime.bind import REGISTERS
from kgen.runtime.record import Built

HEADER = "kgen_launch.hpp"
SOURCE = "kgen_launch.cpp"


class Sym:
    """An integer expression in C++ (int64_t), built by running a Python geometry
    function on it. Only the arithmetic the geometry uses is defined: anything else
    (a comparison, a float) raises, so a function that branches on its argument
    cannot be silently mistranslated."""

    def __init__(self, expr: str):
        self.expr = expr

    @staticmethod
    def _c(v) -> str:
        if isinstance(v, Sym):
            return v.expr
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"not an integer expression: {v!r}")
        return f"INT64_C({v})" if abs(v) > 2**31 - 1 else str(v)

    def _bin(self, op: str, a, b) -> Sym:
        return Sym(f"({self._c(a)} {op} {self._c(b)})")

    def __add__(self, o):
        return self if not isinstance(o, Sym) and o == 0 else self._bin("+", self, o)

    def __radd__(self, o):
        return self if not isinstance(o, Sym) and o == 0 else self._bin("+", o, self)

    def __sub__(self, o):
        return self._bin("-", self, o)

    def __rsub__(self, o):
        return self._bin("-", o, self)

    def __mul__(self, o):
        return self._bin("*", self, o)

    def __rmul__(self, o):
        return self._bin("*", o, self)

    def __floordiv__(self, o):  # Python's floor division, not C's truncation
        return Sym(f"fdiv({self._c(self)}, {self._c(o)})")

    def __rfloordiv__(self, o):
        return Sym(f"fdiv({self._c(o)}, {self._c(self)})")

    def __neg__(self):
        return Sym(f"(-{self.expr})")

    def __bool__(self):
        raise TypeError("a symbolic geometry argument cannot be branched on")

    def __eq__(self, o):
        raise TypeError("a symbolic geometry argument cannot be compared")

    __hash__ = None


def expr(v) -> str:
    return Sym._c(v)


def _expr(v) -> str | None:
    """``expr`` of a geometry value an op answers; None where it has none."""
    return None if v is None else expr(v)


HD, G, N = Sym("hd"), Sym("G"), Sym("n")


# The arguments the hand-written port in templates/c/kgen_launch.cpp.j2 names, whatever
# kernels a build holds (a build of one spec file may have no kernel taking some).
ALWAYS = {
    **{n: "tensor" for n in (
        "q", "k_cache", "v_cache", "k_sink", "v_sink", "k_win", "v_win", "out", "sinks",
        "m_out", "l_out", "acc_out", "m_in", "l_in", "acc_in", "block_table", "seq_lens",
        "query_start_loc", "slot_mapping", "pos", "k_new", "v_new", "qg", "z", "query", "key",
        "value", "block_key", "block_value", "ctx_key", "ctx_value", "cu_seqlens")},
    **{n: "int" for n in (
        "sink", "win", "kv_groups", "head_dim", "block_size", "max_blocks", "num_reqs", "kps",
        "splits_cap", "max_seq", "seq_len", "n_splits", "split_len", "pos0", "n_rows",
        "n_head_kv", "total", "n_head", "num_pages", *HOST_BOUNDS)},
    # the MLA ops (the latent cache's store and gather, the split decode)
    **{n: "tensor" for n in ("kv_c", "k_pe", "kv_cache", "dst", "src_cache", "cu_seq_lens",
                             "token_to_seq", "seq_starts", "query", "lse", "key", "value",
                             "cu_seqlens_q", "cu_seqlens_k")},
    **{n: "int" for n in ("n_slots", "kv_c_stride", "k_pe_stride", "num_blocks", "num_tokens",
                          "n_head", "kv_splits", "total_q", "max_seqlen_q")},
    # merge_attn_states and the DFlash ops (their op-level entry points)
    **{n: "tensor" for n in ("output", "output_lse", "prefix_output", "prefix_lse",
                             "suffix_output", "suffix_lse")},
    "n_tokens": "int",
    "context_lens": "tensor",  # mask_empty_context_lse's binder
    **{n: ("int" if p.kind is int else "float") for n, p in PARAMS.items()},
}


@dataclass(frozen=True)
class Field:
    """One argument of any kernel: an array (a Tensor), an int or a float."""

    name: str
    kind: str  # "tensor", "int", "float"


def _fields(kernels) -> list[Field]:
    """Every argument name of every kernel (kernel parameters and launcher-only
    scalars), sorted: the generic Args' slots."""
    seen: dict[str, str] = {}
    for k in kernels:
        for p in params(k):
            seen[p.name] = "tensor" if p.is_pointer else ("float" if p.ctype == "float"
                                                           else "int")
        for a in py_args(k)[1]:
            if a.name in HOST_BOUNDS:
                seen[a.name] = "int"
    seen.update({n: kind for n, kind in ALWAYS.items() if n not in seen})
    return [Field(n, seen[n]) for n in sorted(seen) if n != "validate_pos"]


def _cpp_default(name: str, ann: str, default: str | None) -> str | None:
    """A launcher scalar's default as C++ (None: required)."""
    if name in SHADOW_SCALARS:  # bind: a.get(name, 0)
        return "0"
    if default is None:
        return None
    if default == "None":
        return "std::nullopt"
    p = PARAMS.get(name)
    if p is not None and p.kind is float:
        return repr(float(p.default))
    return default


def _kernel_view(k: Built, index: int, fatbin: str, spec: str) -> dict:
    fmt = k.pair  # the cache's formats: each role's rows, shadows and scales
    cache = get(k.op).cache
    own = get(k.op).cpp_view(k, HD, G, N)  # the op's own: its tiling and geometry
    arrays, scalars = py_args(k)
    args = [{"name": a.name, "kind": "tensor", "default": None} for a in arrays]
    for a in scalars:
        if a.name == "validate_pos":  # the C++ host reads no device memory
            continue
        kind = "float" if a.annotation.startswith("float") else "int"
        args.append({"name": a.name, "kind": kind,
                     "default": _cpp_default(a.name, a.annotation, a.default)})
    for a in args:
        a["ctype"] = {"tensor": "Tensor", "int": "std::int64_t", "float": "double"}[a["kind"]]
        if a["default"] == "std::nullopt":
            a["ctype"] = f"std::optional<{a['ctype']}>"
    # each parameter's kind, and an array's alignment contract (Param.align; 0: a scalar)
    pl = [{"name": p.name, "kind": "tensor" if p.is_pointer else
           ("float" if p.ctype == "float" else "int"), "align": p.align} for p in params(k)]
    v = {
        "name": k.name, "index": index, "module": k.module, "spec": spec, "fatbin": fatbin,
        "doc": k.doc.replace("*/", "* /"), "args": args, "params": pl,
        "op": k.op.name, "mode": k.mode.name, "position": k.position.name,
        "fmt_name": fmt.name, "fmt_block": fmt.block,
        "fmt_shadows": fmt.shadows, "fmt_append_staging": fmt.append_staging,
        "fmt_append_wraps": fmt.append_wraps, "fmt_tensor_scales": fmt.tensor_scales,
        "shadow_mask": sum(1 << i for i, s in enumerate(SHADOWS)
                           if s in fmt.shadow_buffers()),
        "scale_mask": sum(1 << i for i, n in enumerate(TENSOR_SCALES)
                          if n in fmt.scale_scalars()),
        "sink_rows": k.sink_rows, "ring_rows": k.ring_rows, "max_head_dim": k.max_head_dim,
        "max_groups": k.max_groups, "rows_per_block": k.rows_per_block,
        "tile_keys": k.tile_keys, "tile_rows": k.tile_rows, "dot_lanes": k.dot_lanes,
        "kreg_max_chunk": k.kreg_max_chunk,
        "k_registers": k.k_stage is KStage.REGISTERS,
        "v_shared_q4": k.v_stage is VStage.SHARED_Q4,
        "paged_keys": own["paged_keys"],
        "keys_per_step": k.keys_per_step,
        "window_exact": k.window is Window.EXACT, "softcap": k.softcap is SoftCap.TANH,
        "sinks": k.sinks is Sinks.LEARNED,
        "registers": -1 if k.registers is None else k.registers,
        "query_tiles": own["query_tiles"], "padded": own["padded"], "hoisted": own["hoisted"],
        "key_partials": own["key_partials"],
        "combine_staged": geo.combine_staged(k),
        "lse_write": k.lse is Lse.WRITE,  # merge_attn_states, mla_combine
        "stream_head_dim": own["stream_head_dim"], "tile_threads": own["tile_threads"],
        "out_cols": own["out_cols"], "row_lanes": own["row_lanes"],
        "head_dim_step": own["head_dim_step"],
        # The geometry, as the Python functions compute it (symbolic arguments).
        "block_threads": _expr(own["block_threads"]),
        "shared_bytes": _expr(own["shared_bytes"]),
        "row_width": expr(geo.row_width(k, HD)) if cache else None,
        "v_row_width": expr(geo.row_width(k, HD, "v")) if cache else None,
        # x of a prefill's grid in n query rows (a paged form: n is the batch's rows, or
        # for a query tile the bound on one request's rows, max_query_len).
        "prefill_grid_x": _expr(own["prefill_grid_x"]),
    }
    return v


def _ops_view(kernels: list[Built], sources: dict[str, str]) -> dict:
    """What the op-level entry points (templates/c/kgen_ops.*.j2) ask of the build, each
    fact from its Python home: the choice among kernels (``kgen.runtime.select``: the
    pool's order, ``rank``, the option axes and the device-position ``sibling``, all
    static per kernel, so the C++ side only filters by shape, with the ported
    shape_refusal, and takes the first), the roles of ``kgen.runtime.roles``, the plan
    rules of ``kgen.runtime.plan`` and the formats of ``kgen.formats``."""
    from kgen.formats import FORMATS
    from kgen.ir.params import NO_WINDOW
    from kgen.runtime import select
    from kgen.runtime.kv import DEFAULT_KV
    from kgen.runtime.options import NO_SCALES
    from kgen.runtime.plan import (
        PLAN_RULES,
        PREFILL_MAX_SPLITS,
        family_registers,
        plan_registers,
        split_family_registers,
        split_registers,
    )
    from kgen.runtime.roles import ROLES

    # select.generated's pool: kgen_kernels.MODULES (kgen.runtime.manifest.Manifest
    # .modules: modules in first appearance, kernels in manifest order within each).
    first: dict[str, int] = {}
    for i, k in enumerate(kernels):
        first.setdefault(k.module, i)
    pool = sorted(range(len(kernels)), key=lambda i: (first[kernels[i].module], i))
    # min(ok, key=rank) is stable in the pool's order: the position in this order decides.
    ranked = sorted(pool, key=lambda i: select.rank(kernels[i]))
    rank_order = {i: r for r, i in enumerate(ranked)}
    pairs = [(k, None) for k in kernels]
    index = {k.name: i for i, k in enumerate(kernels)}

    def sibling(k) -> int:
        name = select.sibling(k.name, Position.DEVICE, pairs)
        return -1 if name is None else index[name]

    def twin(k) -> int:
        t = select.split_twin(k, pairs)
        return -1 if t is None else index[t[0].name]

    fam = family_registers(kernels)
    split_fam = split_family_registers(kernels)

    def plan_rule(k) -> tuple[int, int, int, int]:
        r = PLAN_RULES.get(k.schedule)
        return (0, 0, 0, 0) if r is None else (r.min_kps, r.threads_per_sm or 0,
                                                r.max_splits or 0, r.batch_floor or 0)

    op_roles = _op_roles()
    # The axes a role may need: the option axes, and those the op-level roles name.
    need_axes = list(select.OPTION_AXES)
    for r in op_roles.values():
        need_axes += [a for a, _ in r.needs if a not in need_axes]
    views = [{
        # a mixed kernel's kv is its pair (q8_0/q4): no cache of one format matches it,
        # as kgen.runtime.select.Role.matches (C++ caches are of one format)
        "index": i, "rank": rank_order[i], "kv": k.pair.name, "op": k.op.value,
        "mode": k.mode.value, "position": k.position.value,
        "options": [getattr(k, a).value for a in need_axes],
        "mla_width": get(k.op).mla_width() if get(k.op).mla else 0,
        "device_sibling": sibling(k),
        "split_twin": twin(k),
        "plan": plan_rule(k),
        "plan_registers": plan_registers(k, fam),
        "split_registers": split_registers(k, split_fam),
        "source_sha256": sources.get(k.name, ""),
    } for i, k in enumerate(kernels)]
    return {
        "pool": pool, "kernels": views, "option_axes": need_axes,
        "min_query_tiles": select.MIN_QUERY_TILES,
        "prefill_max_splits": PREFILL_MAX_SPLITS,
        "op_roles": [{"name": n, "op": r.op.name, "position": r.position.name,
                      "op_value": r.op.value, "position_value": r.position.value,
                      "needs": list(r.needs),
                      "width": get(r.op).mla_width() if get(r.op).mla else 0}
                     for n, r in op_roles.items()],
        "roles": [{"name": n, "op": r.op.name, "position": r.position.name,
                   "mode": "" if r.mode is None else r.mode.name,
                   "has_mode": r.mode is not None,
                   "has_kv": get(r.op).cache, "op_value": r.op.value,
                   "mode_value": "" if r.mode is None else r.mode.value,
                   "position_value": r.position.value} for n, r in ROLES.items()],
        "formats": [{"name": f.name, "shadows": f.shadows, "tensor_scales": f.tensor_scales,
                     "block": f.block, "itemsize": np.dtype(f.dtype).itemsize}
                    for _, f in sorted(FORMATS.items())],
        # kgen.runtime.kv.allocate: the shadows are float16
        "shadow_itemsize": np.dtype(np.float16).itemsize,
        "default_kv": DEFAULT_KV, "no_scales": NO_SCALES, "no_window": NO_WINDOW,
    }


# The C++ OpRole enum's order (templates/c/kgen_ops.cpp.j2: a role's value is its place),
# as the generated API has it; the roles of an op not named here follow, in the registry's
# order.
OP_ROLE_ORDER = (
    "merge", "merge_lse", "mla_store", "mla_decode", "mla_gather_none", "mla_gather_given",
    "mla_combine_none", "mla_prefill_causal_none", "mla_prefill_full_none",
    "mla_combine_write", "mla_prefill_causal_write", "mla_prefill_full_write",
    "dflash_dense", "dflash_paged")


def _op_roles() -> dict:
    """The roles of the op-level entry points beyond the caches, as each op's Python entry
    point builds them (OpDef.cpp_roles): {C++ name: Role}, in OP_ROLE_ORDER."""
    roles = {n: r for op in OPS.values() for n, r in op.cpp_roles().items()}
    place = {n: i for i, n in enumerate(OP_ROLE_ORDER)}
    return {n: roles[n] for n in sorted(roles, key=lambda n: place.get(n, len(place)))}


def _entry_params() -> dict:
    """The op-level entry points' defaults and ranges (kgen.ir.params)."""
    from kgen.ir.params import ENTRY_PARAMS

    p = ENTRY_PARAMS["num_kv_splits"]
    return {"num_kv_splits": {"default": p.default, "lo": p.lo, "hi": p.hi},
            "prefill_tokens_with_context": PARAMS["prefill_tokens_with_context"].default,
            "block_causal": PARAMS["block_causal"].default,
            "sliding_window": PARAMS["sliding_window"].default}


def _mla_geometry() -> dict:
    """The MLA kernels' launch geometry (kgen.ir.geometry) for the C++ port."""
    return {"latent": geo.MLA_LATENT, "rope": geo.MLA_ROPE, "row": geo.MLA_ROW,
            "store_threads": geo.MLA_STORE_THREADS, "threads": geo.MLA_THREADS,
            "gather_threads": geo.mla_gather_threads(),
            "combine_threads": geo.MLA_COMBINE_THREADS,
            "gather_grid_x": expr(geo.mla_gather_grid(Sym("n"))[0]),
            "decode_grid_x": expr(geo.mla_decode_grid(Sym("H"), 1, 1)[0]),
            "prefill_qk": geo.MLA_PREFILL_QK, "prefill_v": geo.MLA_PREFILL_V,
            "prefill_threads": geo.MLA_PREFILL_ROWS * TARGET.warp,
            "prefill_grid_x": expr(geo.mla_prefill_grid(Sym("mq"), 1, 1)[0]),
            "split_keys": geo.MLA_SPLIT_KEYS}


def render_cpp_api(kernels: list[tuple[Built, str, str]], embedded: list[str],
                   header: str, templates: Path, cache_dir: Path | None = None,
                   sources: dict[str, str] | None = None) -> dict[str, str]:
    """{file name: text} of the C++ API over ``kernels`` ((kernel, fatbin path, spec)
    triples in the manifest's order); ``embedded``: the kernels whose fatbins
    ``header`` (the C header) holds; ``sources``: each kernel's source hash (the
    manifest's ``source_sha256``: a tune store's entry for a changed kernel is stale)."""
    from kgen.compiler.render import environment

    env = environment(templates, cache_dir)
    views = [_kernel_view(k, i, fb, spec) for i, (k, fb, spec) in enumerate(kernels)]
    ctx = dict(
        kernels=views, fields=_fields([k for k, _, _ in kernels]),
        specs=sorted({v["spec"] for v in views}),
        modules=sorted({v["module"] for v in views}),
        ops=sorted({v["op"] for v in views}),
        embedded=set(embedded), c_header=header, kgen_version=__version__,
        embedded_modules=sorted({v["module"] for v in views if v["name"] in set(embedded)}),
        ops_api=_ops_view([k for k, _, _ in kernels], sources or {}),
        op_names=[o.name for o in Op], merge_rows=geo.MERGE_ROWS,
        combine_threads=geo.COMBINE_THREADS, combine_dims=geo.COMBINE_DIMS,
        merge_threads=geo.merge_threads(),
        merge_grid_x=expr(geo.merge_grid(Sym("T"), Sym("H"))[0]),
        mla=_mla_geometry(), entry=_entry_params(),
        io_dtypes=[d.value for d in IoDtype],
        mla_ops=sorted(d.op.name for d in OPS.values() if d.mla),
        dflash_rows=geo.DFLASH_ROWS, dflash_threads=geo.dflash_threads(),
        dflash_grid_x=expr(geo.dflash_grid(Sym("T"), Sym("H"))[0]),
        dense_rows=geo.DENSE_ROWS, dense_threads=geo.dense_threads(),
        dense_grid=[expr(x) for x in geo.dense_grid(Sym("T"), Sym("H"), Sym("hk"))[:2]],
        header_name=HEADER, target=TARGET, registers_contract=REGISTERS, int_max=INT_MAX,
        params=[{"name": p.name, "is_int": p.kind is int,
                 "default": ("0" if p.default is None else repr(p.default)),
                 "has_default": p.default is not None, "lo": p.lo,
                 "hi": -1 if p.hi is None else p.hi, "positive": p.positive}
                for p in PARAMS.values()],
    )
    return {HEADER: env.get_template("c/kgen_launch.hpp.j2").render(**ctx),
            SOURCE: env.get_template("c/kgen_launch.cpp.j2").render(**ctx)}
