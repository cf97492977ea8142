"""The compiler's stages, in order, each a function named for what it produces.

    parse   spec files        -> SpecFile ASTs           (kgen.spec.parser)
    check   ASTs              -> resolved, checked IR     (kgen.spec.resolve, kgen.spec.check)
    render  IR + templates    -> CUDA modules             (kgen.render)
    ptx     CUDA              -> PTX       (nvcc 11.8)    (kgen.compile)
    cubin   PTX               -> sm_37 cubin (ptxas)      (kgen.compile)
    sass    cubin             -> SASS listing (cuobjdump) (kgen.compile)
    verify  compiled kernels  -> verdicts vs golden       (kgen.verify)
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kgen import __version__, compile, elf, ptx_entries, resources, sass_listing
from kgen.cache import Cache, sha256
from kgen.errors import KgenError, SpecError
from kgen.render import Module, render_modules, render_ptx_header, render_python
from kgen.spec.ast import SpecFile
from kgen.spec.check import check
from kgen.spec.files import spec_paths
from kgen.spec.ir import Kernel
from kgen.spec.parser import parse_file
from kgen.spec.resolve import resolve
from kgen.toolchain import Toolchain
from kgen.verify import Compiled

MANIFEST = "manifest.json"
PTX_HEADER = "attention_ptx.h"


def parse(inputs: list[Path], root: Path | None = None) -> list[SpecFile]:
    files = []
    for p in spec_paths(inputs):
        shown = str(p)
        if root is not None:
            with contextlib.suppress(ValueError):
                shown = str(p.resolve().relative_to(root))
        files.append(parse_file(p, shown))
    return files


def with_parents(files: list[SpecFile], root: Path | None = None) -> list[SpecFile]:
    """``files`` plus, from the other specs beside them, the definitions their
    kernels inherit from (transitively), so one file of a spec set can be checked
    alone. A sibling that does not parse is no context and is skipped."""
    defined = {d.name for f in files for d in f.kernels}
    wanted = {d.parent for f in files for d in f.kernels if d.parent} - defined
    if not wanted:
        return files
    named = {Path(f.path).resolve() for f in files}
    dirs = {(root / f.path if root and not Path(f.path).is_absolute() else Path(f.path)).parent
            for f in files}
    pool: dict[str, tuple[SpecFile, object]] = {}
    for d in sorted(dirs):
        for sib in sorted(d.glob("*.kspec")):
            if sib.resolve() in named:
                continue
            try:
                sf = parse([sib], root)[0]
            except SpecError:
                continue
            for kd in sf.kernels:
                pool.setdefault(kd.name, (sf, kd))
    picked: dict[str, tuple[SpecFile, object]] = {}
    while wanted:
        name = wanted.pop()
        if name in picked or name not in pool:
            continue
        picked[name] = pool[name]
        parent = pool[name][1].parent
        if parent and parent not in defined:
            wanted.add(parent)
    by_file: dict[str, list] = {}
    for sf, kd in picked.values():
        by_file.setdefault(sf.path, [sf, []])[1].append(kd)
    extra = [SpecFile(sf.path, tuple(kds), sf.lines) for sf, kds in by_file.values()]
    return files + extra


def checked(files: list[SpecFile]) -> list[Kernel]:
    return check(resolve(files), {f.path: f.lines for f in files})


@dataclass(frozen=True)
class ModuleBuild:
    """A module after the ptx and cubin stages; the sass stage runs on demand."""

    module: Module
    ptx: str
    cubin: bytes
    ptxas_log: str
    load_sass: Callable[[], dict[str, tuple[sass_listing.Instr, ...]]] = field(compare=False)

    @property
    def sass(self) -> dict[str, tuple[sass_listing.Instr, ...]]:
        return self.load_sass()

    def kernels(self) -> dict[str, Compiled]:
        entries = ptx_entries.entries(self.ptx)
        res = resources.parse(self.ptxas_log)
        code = elf.kernel_code(self.cubin)
        return {
            name: Compiled(name, self.module.name, entries[name], resources=res[name],
                           code=code.get(name, b""),
                           load_sass=lambda n=name: self.load_sass().get(n, ()))
            for name in entries
        }


def toolchain_stages(module: Module, tc: Toolchain, cache: Cache, progress=None) -> ModuleBuild:
    """ptx -> cubin for one module; sass (a disassembly, for showing differences)
    only when asked for."""
    t0 = time.perf_counter()
    ptx_text = compile.ptx(module.source, tc, cache, name=module.name)
    t1 = time.perf_counter()
    if progress:
        progress(f"ptx    {module.name:<14} {t1 - t0:5.2f}s")
    cub = compile.cubin(ptx_text, tc, cache, name=module.name)
    if progress:
        progress(f"cubin  {module.name:<14} {time.perf_counter() - t1:5.2f}s")

    @functools.cache
    def load_sass() -> dict[str, tuple[sass_listing.Instr, ...]]:
        return sass_listing.parse(compile.sass(cub.data, tc, cache, name=module.name))

    return ModuleBuild(module, ptx_text, cub.data, cub.ptxas_log, load_sass)


def compile_modules(modules: list[Module], tc: Toolchain, cache: Cache,
                    jobs: int = 0, progress=None) -> list[ModuleBuild]:
    """Independent modules compile in parallel (each stage is a subprocess)."""
    jobs = jobs or max(min(len(modules), os.cpu_count() or 1), 1)
    # Longest sources first, so the big modules are not left for last.
    order = sorted(range(len(modules)), key=lambda i: -len(modules[i].source))

    def one(m: Module) -> ModuleBuild:
        return toolchain_stages(m, tc, cache, progress)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(zip(order, pool.map(one, [modules[i] for i in order]), strict=True))
    return [done[i] for i in range(len(modules))]


def check_budgets(kernels: list[Kernel], compiled: dict[str, Compiled],
                  lines: dict[str, tuple[str, ...]]) -> None:
    """Every ``expect <resource> <op> <n>`` of a spec, against ptxas's report."""
    for k in kernels:
        c = compiled.get(k.name)
        if c is None:
            raise KgenError(f"{k.name}: the module compiled but has no such entry")
        for b in k.budgets:
            have = getattr(c.resources, b.resource)
            ok = {"<=": have <= b.value, ">=": have >= b.value, "==": have == b.value}[b.op]
            if not ok:
                src = lines.get(b.pos.path, ())
                raise SpecError(b.pos, f"{k.name} uses {have} {b.resource.replace('_', ' ')}; "
                                f"the spec expects {b.resource} {b.op} {b.value}",
                                src[b.pos.line - 1] if 0 < b.pos.line <= len(src) else None)


def generated_files(builds: list[ModuleBuild], templates: Path, root: Path) -> dict[str, bytes]:
    """The exact contents of generated/: CUDA, PTX, Python launchers, C header, manifest."""
    files: dict[str, bytes] = {}
    manifest = {"generator": f"kgen {__version__}", "modules": {}}
    for b in builds:
        m = b.module
        files[m.filename] = m.source.encode()
        ptx_name = f"{m.name}.ptx"
        header = (f"// GENERATED by kgen {__version__} from {m.filename} with nvcc 11.8 "
                  f"-ptx -arch=sm_37 -- do not edit.\n")
        files[ptx_name] = (header + b.ptx).encode()
        manifest["modules"][m.name] = {
            "source": m.filename,
            "source_sha256": sha256(m.source.encode()),
            "ptx": ptx_name,
            "python": f"{m.name}.py",
            "kernels": [k.name for k in m.kernels],
        }
    modules = [b.module for b in builds]
    for name, text in render_python(modules, templates, root).items():
        files[name] = text.encode()
    files[PTX_HEADER] = render_ptx_header(  # the .ptx files exactly as written above
        [(b.module.name, [k.name for k in b.module.kernels],
          files[f"{b.module.name}.ptx"].decode()) for b in builds], templates).encode()
    files[MANIFEST] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    return files


def read_generated_modules(generated: Path) -> list[Module]:
    """The committed generated/ sources, as modules (for verify)."""
    try:
        manifest = json.loads((generated / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise KgenError(f"no generated modules in {generated}; run `kgen build specs/`") from None
    mods = []
    for name, info in sorted(manifest["modules"].items()):
        src = (generated / info["source"]).read_text(encoding="utf-8")
        mods.append(Module(name, (), src))
    return mods


__all__ = [
    "parse", "checked", "render_modules", "compile_modules", "check_budgets",
    "generated_files", "read_generated_modules", "toolchain_stages",
]
