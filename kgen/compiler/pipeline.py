"""The compiler's stages: one ordered table, each stage a function named for what it
produces, run by one loop over a slice of the table.

    work = Work(inputs=(Path("specs"),))
    for name in BUILD:
        work = STAGES[name](work, ctx)       # what ``run(BUILD, work, ctx)`` does

A command is a slice (the stages it needs, in table order): ``BUILD``, ``CHECK``,
``VERIFY``, ``GOLDEN``. Program stages take and return the whole ``Work``; the
unit stages (cubin, fatbin, sass) take and return one ``ModuleBuild``, and a run of
them is chained per compile unit, units in parallel. The compile unit is one kernel
(its own translation unit; the reference is one unit of all its kernels): every
artifact is stored under the digest of its input, so a new or changed kernel compiles
that kernel alone. Everything a stage needs from outside (paths, cache, toolchain,
jobs, progress) comes in through ``Context``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from kgen import __version__
from kgen.compiler.coverage import block_misfit
from kgen.compiler.cpp_api import render_cpp_api
from kgen.compiler.golden import Golden, golden_files, load_golden
from kgen.compiler.render import (
    Module,
    render_batch,
    render_c_header,
    render_units,
    spec_rel,
)
from kgen.compiler.spec.ast import ExpectRelation, KernelDef, SpecFile
from kgen.compiler.spec.check import Beside, check, check_names_beside
from kgen.compiler.spec.expand import expand_file
from kgen.compiler.spec.files import SPEC_SUFFIX, spec_paths
from kgen.compiler.spec.parser import parse_file
from kgen.compiler.spec.resolve import resolve
from kgen.compiler.verify import Compiled, Verdict, compare
from kgen.config import Settings
from kgen.errors import KgenError, SpecError, ToolError
from kgen.ir.kernel import Kernel
from kgen.ir.target import TARGET
from kgen.ops import py_args
from kgen.runtime import manifest, record
from kgen.runtime.record import axes_of
from kgen.toolchain import compile, elf, ptx_entries, resources, sass_listing
from kgen.toolchain.cache import Cache, sha256
from kgen.toolchain.locate import Toolchain, find_toolchain

C_HEADER = "attention_kernels.h"
REFERENCE_MODULE = "attention"

Listing = dict[str, tuple[sass_listing.Instr, ...]]


def _quiet(msg: str) -> None:
    pass


@dataclass(frozen=True)
class Context:
    """What the stages get from outside: settings (paths), the artifact cache, the
    toolchain (located on first use, so parse and check never need it), how many
    parallel compiles, and where progress goes."""

    settings: Settings
    cache: Cache
    jobs: int = 0
    progress: Callable[[str], None] = _quiet
    locate_toolchain: Callable[[], Toolchain] = find_toolchain

    @classmethod
    def load(cls, settings: Settings | None = None, *, use_cache: bool = True, jobs: int = 0,
             progress: Callable[[str], None] = _quiet) -> Context:
        settings = settings or Settings.load()
        return cls(settings, Cache(settings.cache_dir, enabled=use_cache), jobs, progress)

    @functools.cached_property
    def toolchain(self) -> Toolchain:
        return self.locate_toolchain()

    @property
    def cache_dir(self) -> Path:
        """Where parser tables and compiled templates are kept (even with --no-cache)."""
        return self.settings.cache_dir


@dataclass(frozen=True)
class ModuleBuild:
    """One compile unit as the stages fill it in: ptx, then cubin, then fatbin
    (both images in one load artifact) or sass."""

    module: Module
    ptx: str = ""
    cubin: bytes = b""
    ptxas_log: str = ""
    fatbin: bytes = b""
    load_sass: Callable[[], Listing] = field(compare=False, default=dict)

    @property
    def sass(self) -> Listing:
        return self.load_sass()

    def kernels(self) -> dict[str, Compiled]:
        entries = ptx_entries.entries(self.ptx)
        res = resources.parse(self.ptxas_log)
        code = elf.kernel_code(self.cubin)
        return {
            name: Compiled(name, self.module.group, entries[name], resources=res[name],
                           code=code.get(name, b""),
                           load_sass=lambda n=name: self.load_sass().get(n, ()))
            for name in entries
        }


@dataclass(frozen=True)
class Work:
    """What flows through the table. A command sets the inputs of its slice (the
    ``inputs`` spec paths, or the ``golden`` and ``wanted`` kernels of verify); each
    stage returns a copy with its product added."""

    inputs: tuple[Path, ...] = ()
    # Spec files beside the inputs whose errors are said already (kgen check's rounds):
    # read only for the definitions the others need.
    aside: frozenset[Path] = frozenset()
    files: tuple[SpecFile, ...] = ()  # parse: the spec files named
    context: tuple[SpecFile, ...] = ()  # context: the specs beside them that they need
    beside: tuple[SpecFile, ...] = ()  # context: every spec file of their set beside them
    kernels: tuple[Kernel, ...] = ()  # check
    modules: tuple[Module, ...] = ()  # render (a unit per kernel) or reference
    builds: tuple[ModuleBuild, ...] = ()  # ptx, cubin, fatbin, sass (one per unit)
    compiled_units: tuple[str, ...] = ()  # ptx: the units not in the store (compiled now)
    outputs: Mapping[Path, Mapping[str, bytes]] = field(default_factory=dict)  # outputs, golden
    golden: Golden | None = None
    wanted: tuple[str, ...] = ()  # the kernels verify compares (all when empty)
    verdicts: tuple[Verdict, ...] = ()  # verify

    @functools.cached_property
    def compiled(self) -> dict[str, Compiled]:
        return {n: c for b in self.builds for n, c in b.kernels().items()}

    @property
    def own_kernels(self) -> tuple[Kernel, ...]:
        """The kernels the named spec files define (not the context's)."""
        mine = {f.path for f in self.files}
        return tuple(k for k in self.kernels if k.spec_path in mine)

    @property
    def lines(self) -> dict[str, tuple[str, ...]]:
        return {f.path: f.lines for f in (*self.files, *self.context)}


# -- parse, context, check ---------------------------------------------------------------


def parse(inputs: list[Path], root: Path | None = None,
          cache_dir: Path | None = None) -> list[SpecFile]:
    """Every spec file named or found in a named directory, parsed; paths under
    ``root`` are shown relative to it."""
    files = []
    for p in spec_paths(inputs):
        shown = str(p)
        if root is not None:
            with contextlib.suppress(ValueError):
                shown = str(Path(os.path.realpath(p)).relative_to(os.path.realpath(root)))
        files.append(parse_file(p, shown, cache_dir))
    return files


def spec_files(work: Work, ctx: Context) -> Work:
    return replace(work, files=tuple(parse(list(work.inputs), ctx.settings.root,
                                           ctx.cache_dir)))


def _needs(d: KernelDef) -> set[str]:
    """The names a definition cannot be resolved and checked without."""
    return {n for n in (d.parent, *_relations(d)) if n}


def _relations(d: KernelDef) -> set[str]:
    return {e.other for e in d.expects if isinstance(e, ExpectRelation)}


def _beside(inputs: tuple[Path, ...], ctx: Context
            ) -> tuple[list[tuple[Path, SpecFile]], list[tuple[Path, SpecError]]]:
    """The other spec files beside the spec files ``inputs`` name, families expanded,
    in directory order, each with its real path; and the errors of those that do not
    parse or expand, in the same order (``spec_context`` says what they mean)."""
    named = {Path(os.path.realpath(p)) for p in spec_paths(list(inputs))}
    beside = {Path(os.path.realpath(s)) for p in named for s in p.parent.glob(f"*{SPEC_SUFFIX}")}
    out, errors = [], []
    for sib in sorted(beside - named):
        try:
            out.append((sib, expand_file(parse([sib], ctx.settings.root, ctx.cache_dir)[0])))
        except SpecError as exc:
            errors.append((sib, exc))
    return out, errors


def _one_set(files: list[SpecFile]) -> bool:
    """Whether spec files form one spec set: no kernel name defined twice among them
    (tests/fixtures/invalid, a file per mistake, is no set)."""
    names = [d.name for f in files for d in f.kernels]
    return len(names) == len(set(names))


def spec_context(work: Work, ctx: Context) -> Work:
    """The specs beside the named ones that checking them needs. Where the files beside
    form one set with them, that is every file beside: the named files are checked
    against the whole set, as their directory's check checks them, so what the
    directory refuses (a kernel beside that relates to one the named file no longer
    defines, one the named file's change breaks, a broken file beside) the file is
    refused too, with the same error; and the set is there for the rules that span its
    files (kernel and module names). A file beside that does not parse is then the
    set's first error, as it is the directory's.

    Specs beside each other need not form one set (tests/fixtures/invalid does not):
    then only the definitions the named specs need are read (parents and relation
    targets, transitively with theirs), and a file beside that does not parse is no
    context. So are the files ``work.aside`` names in a set (their errors are said)."""
    files = tuple(expand_file(f) for f in work.files)
    beside, broken = _beside(work.inputs, ctx)
    spec_set = _one_set([f for _, f in beside])
    whole: list[SpecFile] = []
    if spec_set:
        said = [exc for path, exc in broken if path not in work.aside]
        if said:
            raise said[0]
        whole = [f for path, f in beside if path not in work.aside]
    have = (*files, *whole)
    defined = {d.name for f in have for d in f.kernels}
    pool: dict[str, tuple[SpecFile, KernelDef]] = {}
    for _, sf in beside:
        for kd in sf.kernels:
            pool.setdefault(kd.name, (sf, kd))
    wanted = {n for f in have for d in f.kernels for n in _needs(d)} - defined
    picked: dict[str, tuple[SpecFile, KernelDef]] = {}
    while wanted:
        name = wanted.pop()
        if name in picked or name not in pool:
            continue
        picked[name] = pool[name]
        wanted |= _needs(pool[name][1]) - defined
    by_file: dict[str, list] = {}
    for name in sorted(picked, key=list(pool).index):  # as the directory lists them
        sf, kd = picked[name]
        by_file.setdefault(sf.path, [sf, []])[1].append(kd)
    extra = tuple(replace(sf, kernels=tuple(kds)) for sf, kds in by_file.values())
    return replace(work, files=files, context=(*whole, *extra),
                   beside=tuple(f for _, f in beside) if spec_set else ())


def checked(files: list[SpecFile], context: list[SpecFile] | tuple[SpecFile, ...] = (),
            beside: list[SpecFile] | tuple[SpecFile, ...] = ()) -> list[Kernel]:
    """Resolved kernels with every contract checked (the ``check`` stage's work):
    ``files`` with the definitions they need from ``context``; ``beside``, the rest of
    their spec set, for the rules that span its files (a name defined once, modules)."""
    every = [*files, *context]
    lines = {f.path: f.lines for f in every}
    if not beside:
        return check(resolve(every), lines)
    rest = Beside.of(beside)
    check_names_beside(files, rest, lines)
    return check(resolve(every), lines, named={f.path for f in files},
                 named_defs={d.name: d.pos for f in files for d in f.kernels}, beside=rest)


def checked_kernels(work: Work, ctx: Context) -> Work:
    return replace(work, kernels=tuple(checked(list(work.files), work.context, work.beside)))


# -- compile units: one per generated kernel, or the reference ------------------------------


def cuda_modules(work: Work, ctx: Context) -> Work:
    s = ctx.settings
    return replace(work, modules=tuple(render_units(list(work.own_kernels), s.templates,
                                                    s.root, ctx.cache_dir)))


def reference_module(work: Work, ctx: Context) -> Work:
    ref = ctx.settings.reference
    if not ref.is_file():
        raise KgenError(f"reference not found: {ref} (set KGEN_REFERENCE or [tool.kgen] "
                        "reference)")
    return replace(work, modules=(Module(REFERENCE_MODULE, (), ref.read_text("utf-8")),))


# -- ptx for every unit; then cubin -> fatbin | sass, per unit ------------------------------


def _ptx_alone(b: ModuleBuild, ctx: Context) -> str:
    try:
        return compile.ptx(b.module.source, ctx.toolchain, ctx.cache, name=b.module.name)
    except ToolError as exc:
        raise _named_in(exc, b.module, ctx.settings.root) or exc from None


def _ptx_batch(group: str, misses: list[ModuleBuild], ctx: Context) -> dict[str, str]:
    """The PTX of the units of one module that miss the store, from one front-end run
    over them together, split kernel by kernel and stored under each unit's own key
    (what each compiles to alone: kgen.toolchain.ptx_entries.split_module). When the
    batch fails to compile, each unit is compiled alone, so the error names its kernel."""
    s = ctx.settings
    kernels = [k for b in misses for k in b.module.kernels]
    batch = render_batch(group, kernels, s.templates, s.root, ctx.cache_dir)
    try:
        text = compile.ptx(batch.source, ctx.toolchain, ctx.cache.disabled(), name=group)
    except ToolError:
        return {b.module.name: _ptx_alone(b, ctx) for b in misses}
    parts = ptx_entries.split_module(text)
    if set(parts) != {k.name for k in kernels}:
        raise KgenError(f"{group}: the batch's PTX has entries {sorted(parts)}, expected "
                        f"{sorted(k.name for k in kernels)}")
    for b in misses:
        compile.store_ptx(b.module.source, parts[b.module.name], ctx.toolchain, ctx.cache)
    return {b.module.name: parts[b.module.name] for b in misses}


def ptx(work: Work, ctx: Context) -> Work:
    """Every unit's PTX: from the store, else the misses of each module compiled in one
    nvcc run (modules in parallel, the largest first); a unit that is alone in missing,
    or the reference, compiles by itself."""
    builds = work.builds or tuple(ModuleBuild(m) for m in work.modules)
    have: dict[str, str] = {}
    misses: dict[str, list[ModuleBuild]] = {}
    for b in builds:
        hit = compile.stored_ptx(b.module.source, ctx.toolchain, ctx.cache)
        if hit is not None:
            have[b.module.name] = hit
        else:
            misses.setdefault(b.module.group, []).append(b)

    def one(group: str) -> dict[str, str]:
        t0 = time.perf_counter()
        bs = misses[group]
        got = (_ptx_batch(group, bs, ctx) if len(bs) > 1 and all(b.module.kernels for b in bs)
               else {b.module.name: _ptx_alone(b, ctx) for b in bs})
        ctx.progress(f"ptx    {group:<14} {time.perf_counter() - t0:5.2f}s  "
                     f"{len(bs)} kernel{'s' if len(bs) != 1 else ''}")
        return got

    order = sorted(misses, key=lambda g: -sum(len(b.module.source) for b in misses[g]))
    with ThreadPoolExecutor(max_workers=_jobs(ctx, len(order))) as pool:
        for got in pool.map(one, order):
            have.update(got)
    missed = {b.module.name for bs in misses.values() for b in bs}
    return replace(work, builds=tuple(replace(b, ptx=have[b.module.name]) for b in builds),
                   compiled_units=tuple(b.module.name for b in builds
                                        if b.module.name in missed))


def _named_in(exc: ToolError, module: Module, root: Path) -> SpecError | None:
    """nvcc's error about a kernel's name (a symbol the CUDA headers already declare,
    say) as a spec error at that kernel's definition, not a line of a temporary .cu."""
    # What each error says, without the file it names (a unit's file is its kernel's name).
    errors = [re.sub(r"^.*?error\s*:?\s*", "", re.sub(r"\S*\.cu\b(\(\d+\))?:?", "", ln)).strip()
              for ln in exc.output.splitlines() if "error" in ln]
    for k in module.kernels:
        said = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(k.name)}(?![A-Za-z0-9_])")
        msg = next((ln for ln in errors if said.search(ln)), None)
        if msg is None:
            continue
        src = _source_line(k.pos, root)
        return SpecError(k.pos, f"kernel name '{k.name}' does not compile as a CUDA symbol "
                         f"(nvcc: {msg})", src)
    return None


def _source_line(pos, root: Path) -> str | None:
    path = Path(pos.path)
    try:
        lines = (path if path.is_absolute() else root / path).read_text("utf-8").split("\n")
    except (OSError, UnicodeDecodeError):
        return None
    return lines[pos.line - 1] if 0 < pos.line <= len(lines) else None


def cubin(b: ModuleBuild, ctx: Context) -> ModuleBuild:
    """The cubin and ptxas's report; the SASS listing (a disassembly, for showing
    differences) is made on first use unless the sass stage runs."""
    cub = compile.cubin(b.ptx, ctx.toolchain, ctx.cache, name=b.module.name)

    @functools.cache
    def load_sass() -> Listing:
        return sass_listing.parse(compile.sass(cub.data, ctx.toolchain, ctx.cache,
                                               name=b.module.name))

    return replace(b, cubin=cub.data, ptxas_log=cub.ptxas_log, load_sass=load_sass)


def fatbin_ident(m: Module) -> str:
    """What a module's fatbin says it is (the identifier of each of its images)."""
    return f"GENERATED by kgen {__version__} from {m.filename} -- do not edit"


def fatbin(b: ModuleBuild, ctx: Context) -> ModuleBuild:
    """The load artifact: the sm_37 SASS (exactly the cubin) and the PTX, one fatbin."""
    return replace(b, fatbin=compile.fatbin(b.ptx, b.cubin, ctx.toolchain, ctx.cache,
                                            name=b.module.name, ident=fatbin_ident(b.module)))


def sass(b: ModuleBuild, ctx: Context) -> ModuleBuild:
    b.load_sass()  # made now, in parallel with the other modules; kept by load_sass
    return b


# -- after the toolchain: budgets, outputs, verdicts, golden -------------------------------


def _budget_error(k: Kernel, b, have: int, lines: Mapping[str, tuple[str, ...]]) -> SpecError:
    """At the budget's line when the kernel set it; else at the kernel, naming where
    the inherited budget was set."""
    uses = f"{k.name} uses {have} {b.resource.replace('_', ' ')}"
    budget = f"{b.resource} {b.op} {b.value}"
    if b.owner in ("", k.name):
        pos, msg = b.pos, f"{uses}; the spec expects {budget}"
    else:
        kin = "parent" if k.lineage[1:2] == (b.owner,) else "ancestor"
        pos = k.pos
        msg = (f"{uses}; budget `{budget}` set at {b.pos.path}:{b.pos.line} in {kin} "
               f"'{b.owner}' (restate it here, or `drop expect {b.resource}`)")
    src = lines.get(pos.path, ())
    return SpecError(pos, msg, src[pos.line - 1] if 0 < pos.line <= len(src) else None)


def check_budgets(kernels: tuple[Kernel, ...], compiled: Mapping[str, Compiled],
                  lines: Mapping[str, tuple[str, ...]]) -> None:
    """Every ``expect <resource> <op> <n>`` a kernel has, against ptxas's report."""
    for k in kernels:
        c = compiled.get(k.name)
        if c is None:
            raise KgenError(f"{k.name}: the module compiled but has no such entry")
        for b in k.budgets:
            have = getattr(c.resources, b.resource)
            if not {"<=": have <= b.value, ">=": have >= b.value, "==": have == b.value}[b.op]:
                raise _budget_error(k, b, have, lines)


def check_blocks(kernels: tuple[Kernel, ...], compiled: Mapping[str, Compiled],
                 lines: Mapping[str, tuple[str, ...]]) -> None:
    """Every kernel's block fits the target's per-block limits with ptxas's registers
    and static shared memory (kgen.compiler.coverage.block_misfit); else a spec error
    at the kernel: it would build and then fail its launches."""
    for k in kernels:
        c = compiled.get(k.name)
        if c is None:
            raise KgenError(f"{k.name}: the module compiled but has no such entry")
        why = block_misfit(k, c.resources)
        if why is not None:
            src = lines.get(k.pos.path, ())
            raise SpecError(k.pos, f"{k.name} cannot launch on {TARGET.arch}: {why}",
                            src[k.pos.line - 1] if 0 < k.pos.line <= len(src) else None)


def limits(work: Work, ctx: Context) -> Work:
    check_blocks(work.own_kernels, work.compiled, work.lines)
    return work


def budgets(work: Work, ctx: Context) -> Work:
    check_budgets(work.own_kernels, work.compiled, work.lines)
    return work


def generated_files(builds: tuple[ModuleBuild, ...], ctx: Context) -> dict[str, bytes]:
    """The exact contents of generated/: each kernel's fatbin and source, the C header
    and the manifest the launcher factory reads (kgen.runtime.manifest)."""
    s = ctx.settings
    files: dict[str, bytes] = {}
    entries: dict[str, manifest.Entry] = {}
    for b in builds:
        m = b.module
        (k,) = m.kernels
        source = f"{manifest.SOURCES_DIR}/{m.filename}"
        fatbin_path = f"{manifest.KERNELS_DIR}/{m.name}.fatbin"
        files[source] = m.source.encode()
        files[fatbin_path] = b.fatbin
        arrays, scalars = py_args(k)
        entries[k.name] = manifest.Entry(
            name=k.name, module=m.group, spec=spec_rel(k.spec_path, s.root), doc=k.doc,
            axes=axes_of(k),
            arrays=tuple(manifest.Arg(a.name, a.annotation, a.default, a.dtype)
                         for a in arrays),
            scalars=tuple(manifest.Arg(a.name, a.annotation, a.default, a.dtype)
                          for a in scalars),
            fatbin=fatbin_path, fatbin_sha256=sha256(b.fatbin),
            source=source, source_sha256=sha256(m.source.encode()),
            resources=resources.parse(b.ptxas_log)[k.name].as_dict(),
            relations=tuple({"kind": r.kind, "other": r.other, "tolerance": r.tolerance}
                            for r in k.relations))
    embed = s.c_header_modules
    fatbins = {b.module.name: b.fatbin for b in builds}
    embedded = [(e.module, e.name, fatbins[e.name]) for e in entries.values()
                if embed is None or e.module in embed]
    files[C_HEADER] = render_c_header(embedded, s.templates, ctx.cache_dir).encode()
    built = [(record.kernel(e.name, e.axes, e.resources), e.fatbin, e.spec)
             for e in entries.values()]
    for name, text in render_cpp_api(built, [n for _, n, _ in embedded], C_HEADER,
                                     s.templates, ctx.cache_dir,
                                     {e.name: e.source_sha256 for e in entries.values()}
                                     ).items():
        files[name] = text.encode()
    files[manifest.MANIFEST] = manifest.dump(manifest.Manifest(
        s.generated, f"kgen {__version__}", dict(ctx.toolchain.versions), entries, C_HEADER,
        tuple(sorted({m for m, _, _ in embedded}))))
    return files


def outputs(work: Work, ctx: Context) -> Work:
    """The new contents of generated/ (the command writes it at once)."""
    return replace(work, outputs={ctx.settings.generated: generated_files(work.builds, ctx)})


def verdicts(work: Work, ctx: Context) -> Work:
    golden = work.golden or load_golden(ctx.settings.golden)
    compiled = work.compiled
    unknown = [n for n in work.wanted if n not in golden.ptx and n not in compiled]
    if unknown:
        raise KgenError("unknown kernel(s): " + ", ".join(unknown))
    names = list(work.wanted) or sorted(set(golden.kernels) | set(compiled))
    return replace(work, golden=golden, verdicts=tuple(compare(golden, compiled, names)))


def golden_tree(work: Work, ctx: Context) -> Work:
    (b,) = work.builds
    files = golden_files(ctx.settings.reference.name, b.module.source, b.ptx, b.ptxas_log,
                         b.sass, dict(ctx.toolchain.versions))
    return replace(work, outputs={ctx.settings.golden: files})


# -- the table -------------------------------------------------------------------------------

Stage = Callable[[Work, Context], Work]
ModuleStage = Callable[[ModuleBuild, Context], ModuleBuild]

STAGES: dict[str, Stage | ModuleStage] = {
    "parse": spec_files,            # spec paths      -> SpecFile ASTs     (compiler.spec.parser)
    "context": spec_context,        # + what they need from the specs beside them
    "check": checked_kernels,       # ASTs            -> checked kernels   (resolve, check)
    "render": cuda_modules,         # kernels         -> one CUDA unit a kernel (compiler.render)
    "reference": reference_module,  # the reference   -> one CUDA unit
    "ptx": ptx,                     # CUDA            -> PTX (nvcc 11.8; misses batched per module)
    "cubin": cubin,                 # PTX             -> cubin + ptxas report
    "fatbin": fatbin,               # PTX + cubin     -> fatbin: sm_37 SASS + PTX (fatbinary)
    "sass": sass,                   # cubin           -> SASS listing (cuobjdump)
    "limits": limits,               # ptxas report    vs the target's per-block limits
    "budgets": budgets,             # ptxas report    vs each kernel's expect budgets
    "outputs": outputs,             # everything      -> generated/ files (fatbins, manifest)
    "verify": verdicts,             # compiled        -> verdicts vs golden/   (compiler.verify)
    "golden": golden_tree,          # compiled ref.   -> golden/ files         (compiler.golden)
}
MODULE_STAGES = frozenset({"cubin", "fatbin", "sass"})

CHECK = ("parse", "context", "check")
BUILD = ("parse", "context", "check", "render", "ptx", "cubin", "fatbin", "limits",
         "budgets", "outputs")
VERIFY = ("parse", "context", "check", "render", "ptx", "cubin", "verify")
GOLDEN = ("reference", "ptx", "cubin", "sass", "golden")

# What the progress line says a stage made.
_MADE: dict[str, Callable[[Work], str]] = {
    "parse": lambda w: f"{len(w.files)} spec files",
    "context": lambda w: f"{len(w.context)} spec files beside them",
    "check": lambda w: f"{len(w.kernels)} kernels",
    "render": lambda w: f"{len(w.modules)} units",
    "outputs": lambda w: f"{sum(len(t) for t in w.outputs.values())} files",
    "verify": lambda w: f"{len(w.verdicts)} verdicts",
}


def run(names: tuple[str, ...], work: Work, ctx: Context) -> Work:
    """Run a slice of the table on ``work``: program stages one after another, each
    run of module stages chained per module with the modules in parallel."""
    order = list(STAGES)
    positions = [order.index(n) for n in names]
    if positions != sorted(positions) or len(set(positions)) != len(positions):
        raise ValueError(f"stages {names} are not a slice of the table {tuple(order)}")
    for per_module, group in itertools.groupby(names, key=MODULE_STAGES.__contains__):
        if per_module:
            work = _per_module(tuple(group), work, ctx)
            continue
        for name in group:
            t0 = time.perf_counter()
            work = STAGES[name](work, ctx)
            made = _MADE.get(name, lambda w: "")(work)
            ctx.progress(f"{name:<9} {time.perf_counter() - t0:5.2f}s  {made}".rstrip())
    return work


def _jobs(ctx: Context, n: int) -> int:
    return ctx.jobs or max(min(n, os.cpu_count() or 1), 1)


def _per_module(names: tuple[str, ...], work: Work, ctx: Context) -> Work:
    """Independent units go through the chain in parallel (each stage is a subprocess);
    longest sources first, so the big units are not left for last."""
    builds = work.builds or tuple(ModuleBuild(m) for m in work.modules)
    order = sorted(range(len(builds)), key=lambda i: -len(builds[i].module.source))

    def chain(b: ModuleBuild) -> ModuleBuild:
        for name in names:
            t0 = time.perf_counter()
            b = STAGES[name](b, ctx)
            took = time.perf_counter() - t0
            if took >= 0.02:  # a compile, not a hit in the store
                ctx.progress(f"{name:<6} {b.module.name:<14} {took:5.2f}s")
        return b

    with ThreadPoolExecutor(max_workers=_jobs(ctx, len(builds))) as pool:
        done = dict(zip(order, pool.map(chain, [builds[i] for i in order]), strict=True))
    return replace(work, builds=tuple(done[i] for i in range(len(builds))))
