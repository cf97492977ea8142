"""Stage ``render``: checked kernels -> one CUDA source per module.

One Jinja Environment, StrictUndefined (a missing name is a kgen bug, not an
empty string), templates loaded from files only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2

from kgen import __version__
from kgen.spec.axes import Q4_BLOCK, Q4_BLOCK_BYTES, KvFormat, Op, Position
from kgen.spec.ir import Kernel
from kgen.spellings import NEG_INF, convert
from kgen.view import KernelView

MODULE_TEMPLATE = "module.cu.j2"
SOURCE_SUFFIX = ".cu"


@dataclass(frozen=True)
class Module:
    """A generated translation unit."""

    name: str
    kernels: tuple[Kernel, ...]
    source: str

    @property
    def filename(self) -> str:
        return self.name + SOURCE_SUFFIX


def signature(k: KernelView, width: int = 96) -> str:
    """``__global__ void name(params...)`` with whole parameters packed per line."""
    head = f"__global__ void {k.name}("
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


def environment(templates: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["signature"] = signature
    env.globals["convert"] = convert
    env.globals["NEG_INF"] = NEG_INF
    return env


def _needs(kernels: list[KernelView]) -> dict[str, bool]:
    q4 = [k for k in kernels if k.kv is KvFormat.Q4 and k.op in (Op.FLASH, Op.KV_APPEND)]
    return {
        "fp16": bool(q4) or any(k.byte_layout for k in kernels if k.op is Op.FLASH),
        "q4": bool(q4),
        "q4_quant": any(k.op is Op.KV_APPEND for k in q4),
        "q4_elem": any(k.op is Op.FLASH and not (k.k_registers and k.v_tile) for k in q4),
        "q4_lane_chunk": any(k.op is Op.FLASH and k.k_registers for k in q4),
        "window": any(k.op is Op.FLASH for k in kernels),
        "combine": any(k.op is Op.DECODE_COMBINE for k in kernels),
        "plan": any(k.position is not Position.HOST and k.op in (Op.FLASH, Op.DECODE_COMBINE)
                    for k in kernels),
    }


def render_module(env: jinja2.Environment, name: str, kernels: list[Kernel],
                  root: Path) -> Module:
    views = [KernelView(k) for k in kernels]
    used = sorted({"module.cu.j2", "lib/*.cuh.j2", *(f"kernels/{k.op.value}.cu.j2"
                                                     for k in kernels)})
    spec_paths = sorted({_rel(k.spec_path, root) for k in kernels})
    text = env.get_template(MODULE_TEMPLATE).render(
        module=name,
        kernels=views,
        needs=_needs(views),
        spec_paths=spec_paths,
        template_names=used,
        kgen_version=__version__,
        q4_block=Q4_BLOCK,
        q4_block_bytes=Q4_BLOCK_BYTES,
    )
    return Module(name, tuple(kernels), text)


def _rel(path: str, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return path


def render_modules(kernels: list[Kernel], templates: Path, root: Path) -> list[Module]:
    """Group kernels by their ``module`` key, in first-appearance order."""
    env = environment(templates)
    groups: dict[str, list[Kernel]] = {}
    for k in kernels:
        groups.setdefault(k.module, []).append(k)
    return [render_module(env, name, ks, root) for name, ks in sorted(groups.items())]
