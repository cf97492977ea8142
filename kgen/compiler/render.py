"""Stage ``render``: checked kernels -> one CUDA source per module.

One Jinja Environment, StrictUndefined (a missing name is a kgen bug, not an
empty string), templates loaded from files only.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import jinja2

from kgen import __version__
from kgen.compiler.view import KernelView
from kgen.ir.axes import Position
from kgen.ir.kernel import Kernel
from kgen.ir.spellings import NEG_INF, convert
from kgen.ops import get

MODULE_TEMPLATE = "module.cu.j2"
SOURCE_SUFFIX = ".cu"


@dataclass(frozen=True)
class Module:
    """A translation unit: one generated kernel (the compile unit: the store keys its
    artifacts by this source), the kernels of a module that miss the store (compiled
    together, then split kernel by kernel), or the reference. ``group`` is the spec
    ``module`` its kernels belong to (the generated package's module)."""

    name: str
    kernels: tuple[Kernel, ...]
    source: str
    group: str = ""

    @property
    def filename(self) -> str:
        return self.name + SOURCE_SUFFIX


def signature(k: KernelView, width: int = 96) -> str:
    """``__global__ void name(params...)`` with whole parameters packed per line (a
    kernel with ``min_blocks`` names its launch bounds before its name)."""
    bounds = f"__launch_bounds__({k.block_threads}, {k.min_blocks}) " if k.min_blocks else ""
    head = f"__global__ void {bounds}{k.name}("
    indent = " " * len(head)
    decls = [p.decl + ("," if i < len(k.params) - 1 else ")") for i, p in enumerate(k.params)]
    lines, cur = [], head
    for d in decls:
        if cur.strip() and cur not in (head,) and len(cur) + 1 + len(d) > width:
            lines.append(cur)
            cur = indent + d
        else:
            cur = cur + ("" if cur == head else " ") + d
    lines.append(cur)
    return "\n".join(lines)


@functools.cache
def environment(templates: Path, cache_dir: Path | None = None) -> jinja2.Environment:
    """The one Environment per template directory; compiled templates are kept in
    memory and as bytecode under the kgen cache (``cache_dir``, by default the
    settings'), so unchanged templates are not recompiled by the next process."""
    from kgen.config import Settings

    bytecode = Path(cache_dir or Settings.load().cache_dir) / "jinja"
    bytecode.mkdir(parents=True, exist_ok=True)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
        bytecode_cache=jinja2.FileSystemBytecodeCache(str(bytecode)),
    )
    env.filters["signature"] = signature
    env.globals.update(convert=convert, NEG_INF=NEG_INF, pos_off=pos_off, mapped=Mapped)
    return env


class Mapped(str):
    """A key position a skeleton has already mapped to its physical row (paged: through
    the request's page-table row, as kgen_page_pos_by does), so pos_off maps it no
    more; a contiguous cache's positions are their rows, and a skeleton passes them
    plain."""


def pos_off(k, pos: str, row: str, side=None) -> str:
    """The element offset of key position ``pos``'s row from a kv head's base: ``pos``
    rows of ``row`` elements in a contiguous cache; through the request's page-table
    row in a paged one (a position's rows of every kv head are adjacent there, a stride
    of ``side``'s rows: view.Side, by default the kernel's one stride ``pstride``), unless
    the skeleton mapped it already (``Mapped``)."""
    if k.position is Position.PAGED:
        stride = side.pstride if side is not None else "pstride"
        if isinstance(pos, Mapped):
            return f"(size_t)({pos}) * {stride}"
        return f"(size_t)kgen_page_pos(page_row, {pos}, block_size) * {stride}"
    return f"(size_t){pos} * {row}"


def _uses(k: KernelView) -> dict[str, set[str]]:
    """Which of its formats' device helpers a kernel calls, per format (its op answers:
    the append quantizer, the one-element reader, the lane-chunk reader, the quad
    reader). A format's lib file emits only the helpers in use."""
    return get(k.op).format_uses(k)


def _needs(kernels: list[KernelView], templates: Path) -> dict:
    ops = [(get(k.op), k) for k in kernels]
    flags = set().union(*(op.render_flags(k) for op, k in ops))  # the ops' module flags
    cache_ops = [k for op, k in ops if op.cache]
    formats: dict[str, set[str]] = {}
    for k in cache_ops:
        for name, uses in _uses(k).items():
            formats.setdefault(name, set()).update(uses)
    by_name = {f.name: f for k in cache_ops for f in (k.fmt, k.v_fmt)}
    io = []  # the element types of ops with in_dtype / out_dtype: readers and rounding
    for op, k in ops:
        io += [(k.in_dtype.fmt, "elem")] if op.in_dtype else []
        io += [(k.out_dtype.fmt, "quant")] if op.out_dtype else []
    for fmt, use in io:
        formats.setdefault(fmt.name, set()).add(use)
        by_name[fmt.name] = fmt
    return {
        "fp16": any(k.pair.fp16 for k in cache_ops) or "fp16" in flags
        or any(fmt.fp16 for fmt, _ in io),
        # Device helpers per format in use (templates/lib/<kv>.cuh.j2, if it has one).
        "format_libs": [(by_name[n], uses) for n, uses in sorted(formats.items())
                        if (templates / by_name[n].lib).is_file()],
        "window": "window" in flags,
        "combine": "combine" in flags,
        "merge": "merge" in flags,
        # the merge's row helpers, once per element types of its merge kernels
        "merge_io": list(dict.fromkeys(io for op, k in ops for io in op.merge_io(k))),
        "mla": "mla" in flags,  # split bounds
        "dflash": "dflash" in flags,
        "paged": "paged" in flags,
        "combine_sinks": "combine_sinks" in flags,
        "combine_staged": any(k.combine_staged for k in kernels),
        "exact_window": "exact_window" in flags,
        "plan": any(k.position is not Position.HOST and op.planned for op, k in ops),
    }


def render_module(env: jinja2.Environment, name: str, kernels: list[Kernel],
                  root: Path, group: str | None = None) -> Module:
    views = [KernelView(k) for k in kernels]
    parts = {p for k in kernels for p in get(k.op).template_parts(k)}
    used = sorted({"module.cu.j2", "lib/*.cuh.j2", *(v.template for v in views), *parts,
                   *(f.template for k in kernels if get(k.op).cache
                     for f in (k.fmt, k.v_fmt))})
    spec_paths = sorted({spec_rel(k.spec_path, root) for k in kernels})
    needs = _needs(views, Path(env.loader.searchpath[0]))
    text = env.get_template(MODULE_TEMPLATE).render(
        module=group or name,
        kernels=views,
        needs=needs,
        spec_paths=spec_paths,
        template_names=used,
        kgen_version=__version__,
    )
    return Module(name, tuple(kernels), text, group or name)


def spec_rel(path: str, root: Path) -> str:
    """A spec path as the generated files name it: relative to the project root. The
    parse stage already shows paths under the root relative to it (whatever the working
    directory); an absolute path is made relative when it lies under the root."""
    p = Path(path)
    if not p.is_absolute():
        return path
    try:
        return str(Path(os.path.realpath(p)).relative_to(os.path.realpath(root)))
    except ValueError:
        return path


def groups(kernels) -> dict[str, list[Kernel]]:
    """Kernels by their ``module`` key: modules sorted by name, kernels in spec order."""
    out: dict[str, list[Kernel]] = {}
    for k in kernels:
        out.setdefault(k.module, []).append(k)
    return dict(sorted(out.items()))


def render_units(kernels: list[Kernel], templates: Path, root: Path,
                 cache_dir: Path | None = None) -> list[Module]:
    """One translation unit per kernel (what the build compiles and the store keys),
    modules sorted by name, kernels in spec order within each."""
    env = environment(templates, cache_dir)
    return [render_module(env, k.name, [k], root, group)
            for group, ks in groups(kernels).items() for k in ks]


def render_batch(group: str, kernels: list[Kernel], templates: Path, root: Path,
                 cache_dir: Path | None = None) -> Module:
    """The kernels of one module as one translation unit (compiled at once when
    several miss the store, then split kernel by kernel)."""
    return render_module(environment(templates, cache_dir), group, kernels, root)


C_BYTES_PER_LINE = 16
_C_BYTE = tuple(f"0x{b:02x}" for b in range(256))


def _c_bytes(data: bytes) -> list[str]:
    """Bytes as the lines of a C array initializer, ``C_BYTES_PER_LINE`` to a line."""
    return [", ".join(map(_C_BYTE.__getitem__, data[i:i + C_BYTES_PER_LINE])) + ","
            for i in range(0, len(data), C_BYTES_PER_LINE)]


def render_c_header(kernels: list[tuple[str, str, bytes]], templates: Path,
                    cache_dir: Path | None = None) -> str:
    """The C header embedding each kernel's fatbin as a byte array: (module, kernel,
    fatbin) triples, in the manifest's order."""
    env = environment(templates, cache_dir)
    items = [{"module": m, "name": n, "size": len(fb), "byte_lines": _c_bytes(fb)}
             for m, n, fb in kernels]
    return env.get_template("c/kernels_header.h.j2").render(
        kernels=items, modules=sorted({m for m, _, _ in kernels}), kgen_version=__version__)
