"""The compiler's stages: one ordered table, each stage a function named for what it
produces, run by one loop over a slice of the table.

    work = Work(inputs=(Path("specs"),))
    for name in BUILD:
        work = STAGES[name](work, ctx)       # what ``run(BUILD, work, ctx)`` does

A command is a slice (the stages it needs, in table order): ``BUILD``, ``CHECK``,
``VERIFY``, ``GOLDEN``. Program stages take and return the whole ``Work``; the
module stages (ptx, cubin, fatbin, sass) take and return one ``ModuleBuild``, and a run of
them is chained per module, modules in parallel. Everything a stage needs from
outside (paths, cache, toolchain, jobs, progress) comes in through ``Context``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from kgen import __version__
from kgen.compiler.golden import Golden, golden_files, load_golden
from kgen.compiler.render import (
    Module,
    render_c_header,
    render_modules,
    render_python,
    render_tests,
)
from kgen.compiler.spec.ast import ExpectRelation, KernelDef, SpecFile
from kgen.compiler.spec.check import check
from kgen.compiler.spec.expand import expand_file
from kgen.compiler.spec.files import SPEC_SUFFIX, partial, spec_paths
from kgen.compiler.spec.parser import parse_file
from kgen.compiler.spec.resolve import resolve
from kgen.compiler.verify import Compiled, Verdict, compare
from kgen.config import Settings
from kgen.errors import KgenError, SpecError, ToolError
from kgen.ir.kernel import Kernel
from kgen.toolchain import compile, elf, ptx_entries, resources, sass_listing
from kgen.toolchain.cache import Cache, sha256
from kgen.toolchain.locate import Toolchain, find_toolchain

MANIFEST = "manifest.json"
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
    """One module as the module stages fill it in: ptx, then cubin, then fatbin
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
            name: Compiled(name, self.module.name, entries[name], resources=res[name],
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
    files: tuple[SpecFile, ...] = ()  # parse: the spec files named
    context: tuple[SpecFile, ...] = ()  # context: definitions they need from beside them
    kernels: tuple[Kernel, ...] = ()  # check
    modules: tuple[Module, ...] = ()  # render, read or reference
    builds: tuple[ModuleBuild, ...] = ()  # ptx, cubin, fatbin, sass
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
    others = (e.other for e in d.expects if isinstance(e, ExpectRelation))
    return {n for n in (d.parent, *others) if n}


def _siblings(inputs: tuple[Path, ...], ctx: Context) -> dict[str, tuple[SpecFile, KernelDef]]:
    """name -> (file, definition) for every kernel in the other specs beside the spec
    files ``inputs`` name, families expanded. A sibling that does not parse is no
    context and is skipped."""
    named = {Path(os.path.realpath(p)) for p in spec_paths(list(inputs))}
    pool: dict[str, tuple[SpecFile, KernelDef]] = {}
    beside = {Path(os.path.realpath(s)) for p in named for s in p.parent.glob(f"*{SPEC_SUFFIX}")}
    for sib in sorted(beside):
        if sib in named:
            continue
        try:
            sf = expand_file(parse([sib], ctx.settings.root, ctx.cache_dir)[0])
        except SpecError:
            continue
        for kd in sf.kernels:
            pool.setdefault(kd.name, (sf, kd))
    return pool


def spec_context(work: Work, ctx: Context) -> Work:
    """The definitions the named specs need from the specs beside them: parents and
    relation targets, transitively with theirs, so one file of a spec set resolves
    and checks every name as its directory does. Only what is needed is read: specs
    beside each other need not form one set (tests/fixtures/invalid does not)."""
    files = tuple(expand_file(f) for f in work.files)
    defined = {d.name for f in files for d in f.kernels}
    wanted = {n for f in files for d in f.kernels for n in _needs(d)} - defined
    pool = _siblings(work.inputs, ctx) if wanted else {}
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
    return replace(work, files=files, context=extra)


def checked(files: list[SpecFile]) -> list[Kernel]:
    """Resolved kernels with every contract checked (the ``check`` stage's work)."""
    return check(resolve(files), {f.path: f.lines for f in files})


def checked_kernels(work: Work, ctx: Context) -> Work:
    return replace(work, kernels=tuple(checked([*work.files, *work.context])))


# -- modules: rendered, read back from generated/, or the reference ------------------------


def cuda_modules(work: Work, ctx: Context) -> Work:
    s = ctx.settings
    return replace(work, modules=tuple(render_modules(list(work.own_kernels), s.templates,
                                                      s.root, ctx.cache_dir)))


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


def generated_modules(work: Work, ctx: Context) -> Work:
    return replace(work, modules=tuple(read_generated_modules(ctx.settings.generated)))


def reference_module(work: Work, ctx: Context) -> Work:
    ref = ctx.settings.reference
    if not ref.is_file():
        raise KgenError(f"reference not found: {ref} (set KGEN_REFERENCE or [tool.kgen] "
                        "reference)")
    return replace(work, modules=(Module(REFERENCE_MODULE, (), ref.read_text("utf-8")),))


# -- the module stages: ptx -> cubin -> fatbin | sass, per module --------------------------


def ptx(b: ModuleBuild, ctx: Context) -> ModuleBuild:
    try:
        text = compile.ptx(b.module.source, ctx.toolchain, ctx.cache, name=b.module.name)
    except ToolError as exc:
        raise _named_in(exc, b.module, ctx.settings.root) or exc from None
    return replace(b, ptx=text)


def _named_in(exc: ToolError, module: Module, root: Path) -> SpecError | None:
    """nvcc's error about a kernel's name (a symbol the CUDA headers already declare,
    say) as a spec error at that kernel's definition, not a line of a temporary .cu."""
    errors = [ln for ln in exc.output.splitlines() if "error" in ln]
    for k in module.kernels:
        said = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(k.name)}(?![A-Za-z0-9_])")
        hit = next((ln for ln in errors if said.search(ln)), None)
        if hit is None:
            continue
        msg = re.sub(r"^.*?error\s*:?\s*", "", hit).strip()
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


def budgets(work: Work, ctx: Context) -> Work:
    check_budgets(work.own_kernels, work.compiled, work.lines)
    return work


@dataclass(frozen=True)
class Carried:
    """A module already in generated/ that a build of other spec files keeps as it is."""

    name: str
    info: dict  # its manifest entry
    files: dict[str, bytes]  # its generated/ files
    test: bytes | None  # tests/generated/test_<name>.py

    @property
    def kernels(self) -> list[str]:
        return list(self.info["kernels"])


def carried_modules(work: Work, ctx: Context) -> list[Carried]:
    """When the build names some spec files of a directory (not all), the modules other
    files made stay in generated/ as they are: building one file never deletes another's
    outputs. A module the named files share with another file is refused (built alone
    it would lose that file's kernels)."""
    if not partial(work.inputs):
        return []
    s = ctx.settings
    try:
        manifest = json.loads((s.generated / MANIFEST).read_text(encoding="utf-8"))
        entries = dict(manifest["modules"])
    except (OSError, ValueError, KeyError, TypeError):
        return []  # nothing built yet: the named files' modules are the whole tree
    built = {b.module.name for b in work.builds}
    own = {k.name for k in work.own_kernels}
    elsewhere = set(_siblings(work.inputs, ctx))
    out = []
    for name, info in sorted(entries.items()):
        if name in built:
            others = [k for k in info.get("kernels", ()) if k not in own and k in elsewhere]
            if others:
                raise KgenError(
                    f"module '{name}' also holds kernels that other spec files define "
                    f"({', '.join(others[:4])}{', ...' if len(others) > 4 else ''}); build "
                    "the spec files together (e.g. `kgen build specs/`)")
            continue
        try:
            files = {info[key]: (s.generated / info[key]).read_bytes()
                     for key in ("source", "ptx", "python", "fatbin")}
        except (OSError, KeyError, TypeError) as exc:
            raise KgenError(f"{s.generated} is incomplete (module '{name}': {exc}); build "
                            "the whole spec directory (`kgen build specs/`)") from None
        test = s.tests_generated / f"test_{name}.py"
        out.append(Carried(name, info, files, test.read_bytes() if test.is_file() else None))
    return out


def generated_files(builds: tuple[ModuleBuild, ...], ctx: Context,
                    carried: list[Carried] = ()) -> dict[str, bytes]:
    """The exact contents of generated/: CUDA, PTX, fatbin, Python launchers, C header,
    manifest (and the ``carried`` modules' files as they are)."""
    s = ctx.settings
    files: dict[str, bytes] = {}
    manifest = {"generator": f"kgen {__version__}", "modules": {}}
    for c in carried:
        files.update(c.files)
        manifest["modules"][c.name] = c.info
    for b in builds:
        m = b.module
        files[m.filename] = m.source.encode()
        ptx_name = f"{m.name}.ptx"
        header = (f"// GENERATED by kgen {__version__} from {m.filename} with nvcc 11.8 "
                  f"-ptx -arch=sm_37 -- do not edit.\n")
        files[ptx_name] = (header + b.ptx).encode()
        files[f"{m.name}.fatbin"] = b.fatbin
        manifest["modules"][m.name] = {
            "source": m.filename,
            "source_sha256": sha256(m.source.encode()),
            "ptx": ptx_name,
            "fatbin": f"{m.name}.fatbin",
            "fatbin_sha256": sha256(b.fatbin),
            "python": f"{m.name}.py",
            "kernels": [k.name for k in m.kernels],
        }
    modules = [b.module for b in builds]
    listed = sorted([(b.module.name, [k.name for k in b.module.kernels]) for b in builds]
                    + [(c.name, c.kernels) for c in carried])
    for name, text in render_python(modules, s.templates, s.root, ctx.cache_dir,
                                    package=listed).items():
        files[name] = text.encode()
    embed = s.c_header_modules
    fatbins = {b.module.name: b.fatbin for b in builds}
    fatbins.update({c.name: c.files[c.info["fatbin"]] for c in carried})
    files[C_HEADER] = render_c_header(
        [(name, kernels, fatbins[name]) for name, kernels in listed
         if embed is None or name in embed], s.templates, ctx.cache_dir).encode()
    files[MANIFEST] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    return files


def outputs(work: Work, ctx: Context) -> Work:
    """The new contents of generated/ and tests/generated/ (the command writes them
    together, or compares them with what is there)."""
    s = ctx.settings
    carried = carried_modules(work, ctx)
    tests = render_tests([b.module for b in work.builds], s.templates, s.root, ctx.cache_dir,
                         related=work.kernels)
    test_files = {n: t.encode() for n, t in tests.items()}
    test_files.update({f"test_{c.name}.py": c.test for c in carried if c.test is not None})
    return replace(work, outputs={
        s.generated: generated_files(work.builds, ctx, carried),
        s.tests_generated: test_files,
    })


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
    "render": cuda_modules,         # kernels         -> CUDA modules      (kgen.compiler.render)
    "read": generated_modules,      # generated/      -> CUDA modules
    "reference": reference_module,  # the reference   -> one CUDA module
    "ptx": ptx,                     # CUDA            -> PTX (nvcc 11.8)   (kgen.toolchain.compile)
    "cubin": cubin,                 # PTX             -> cubin + ptxas report
    "fatbin": fatbin,               # PTX + cubin     -> fatbin: sm_37 SASS + PTX (fatbinary)
    "sass": sass,                   # cubin           -> SASS listing (cuobjdump)
    "budgets": budgets,             # ptxas report    vs each kernel's expect budgets
    "outputs": outputs,             # everything      -> generated/ + tests/generated/ files
    "verify": verdicts,             # compiled        -> verdicts vs golden/   (compiler.verify)
    "golden": golden_tree,          # compiled ref.   -> golden/ files         (compiler.golden)
}
MODULE_STAGES = frozenset({"ptx", "cubin", "fatbin", "sass"})

CHECK = ("parse", "context", "check")
BUILD = ("parse", "context", "check", "render", "ptx", "cubin", "fatbin", "budgets",
         "outputs")
VERIFY = ("read", "ptx", "cubin", "verify")
GOLDEN = ("reference", "ptx", "cubin", "sass", "golden")

# What the progress line says a stage made.
_MADE: dict[str, Callable[[Work], str]] = {
    "parse": lambda w: f"{len(w.files)} spec files",
    "context": lambda w: f"{len(w.context)} spec files beside them",
    "check": lambda w: f"{len(w.kernels)} kernels",
    "render": lambda w: f"{len(w.modules)} modules",
    "read": lambda w: f"{len(w.modules)} modules",
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


def _per_module(names: tuple[str, ...], work: Work, ctx: Context) -> Work:
    """Independent modules go through the chain in parallel (each stage is a subprocess);
    longest sources first, so the big modules are not left for last."""
    builds = work.builds or tuple(ModuleBuild(m) for m in work.modules)
    order = sorted(range(len(builds)), key=lambda i: -len(builds[i].module.source))

    def chain(b: ModuleBuild) -> ModuleBuild:
        for name in names:
            t0 = time.perf_counter()
            b = STAGES[name](b, ctx)
            ctx.progress(f"{name:<6} {b.module.name:<14} {time.perf_counter() - t0:5.2f}s")
        return b

    jobs = ctx.jobs or max(min(len(builds), os.cpu_count() or 1), 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(zip(order, pool.map(chain, [builds[i] for i in order]), strict=True))
    return replace(work, builds=tuple(done[i] for i in range(len(builds))))
