"""kgen: build, verify, golden, freeze, check, list, show."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import traceback
from pathlib import Path

from kgen import __version__
from kgen.config import Settings
from kgen.errors import KgenError, SpecError, UsageError

# The compiler stages (lark, jinja2, numpy) are imported by the commands that
# run them, so a no-op `kgen build` answers without loading them.


class Reporter:
    """Progress on stderr (a terminal unless --quiet); results on stdout. Lines from
    parallel compiles are written whole, one at a time."""

    def __init__(self, quiet: bool, as_json: bool):
        self.quiet = quiet or as_json
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            line = f"[{time.perf_counter() - self.t0:6.2f}s] {msg}\n"
            with self._lock:
                sys.stderr.write(line)
                sys.stderr.flush()


def _context(settings: Settings, args, say: Reporter | None = None):
    """The stages' context: settings, cache, jobs and progress (none for the commands
    whose only output is their answer) from the command line."""
    from kgen.compiler.pipeline import Context

    quiet = {"progress": say} if say else {}
    return Context.load(settings, use_cache=not getattr(args, "no_cache", False),
                        jobs=getattr(args, "jobs", 0), **quiet)


def _inputs(settings: Settings, inputs: list[str] | None) -> tuple[Path, ...]:
    return tuple(Path(p) for p in inputs) if inputs else (settings.specs,)


def _kernels(settings: Settings, args):
    from kgen.compiler import pipeline

    work = pipeline.run(("parse", "check"), pipeline.Work(inputs=_inputs(settings, None)),
                        _context(settings, args))
    return work.kernels


def _fresh_build(settings: Settings, args) -> str | None:
    """The build's input digest, or None when a build must run anyway."""
    from kgen.compiler import stamp
    from kgen.compiler.spec.files import SPEC_SUFFIX, spec_paths

    if args.no_cache:
        return None
    try:
        named = spec_paths(list(_inputs(settings, args.specs)))
        beside = {s for p in named for s in p.parent.glob(f"*{SPEC_SUFFIX}")} | set(named)
        return stamp.input_digest(sorted(beside), settings.templates,
                                  [os.path.realpath(p) for p in named])
    except (OSError, KgenError):
        return None  # an unreadable input: the full build reports it properly


def cmd_build(args, settings: Settings, say: Reporter) -> int:
    """Builds of one output directory exclude each other where it matters (a lock
    beside each output directory): a swap a crash interrupted is finished and stale
    scratch trees are removed first; the compiles run in parallel with other builds
    (the store takes each artifact whole or not at all); writing both trees and
    recording the no-op stamp happen under the lock, so the stamp always describes
    the tree it was recorded for. The trees hold exactly the kernels of the spec
    files named (every file of a named directory)."""
    from dataclasses import replace

    from kgen.compiler import pipeline, stamp
    from kgen.compiler.atomic import lock, recover, replace_dirs
    from kgen.toolchain.compile import clean_workdirs

    if args.out:  # the named specs' kernels into a tree of their own
        settings = replace(settings, generated=Path(args.out))
    gen = settings.generated
    if gen.is_symlink():  # a tree kept elsewhere (another disk): written where it points
        settings = replace(settings, generated=Path(os.path.realpath(gen)))
    elif gen.exists() and not gen.is_dir():
        raise KgenError(f"{gen} is not a directory; kgen build writes its output tree there "
                        "(remove it, or name another place with KGEN_GENERATED)")
    outputs_dirs = [settings.generated]
    with lock(outputs_dirs, say):
        for msg in recover(outputs_dirs):
            say(msg)
        for d in clean_workdirs():
            say(f"removed {d} (a tool work directory of a process that is gone)")
    digest = _fresh_build(settings, args)
    if digest is not None:
        with lock(outputs_dirs, say):
            fresh = stamp.is_fresh(settings.cache_dir, digest, outputs_dirs)
        if fresh:
            if args.json:
                print(json.dumps({"up_to_date": True}))
            else:
                print("up to date (inputs and outputs unchanged)")
            return 0
    work = pipeline.run(pipeline.BUILD, pipeline.Work(inputs=_inputs(settings, args.specs)),
                        _context(settings, args, say))
    with lock(outputs_dirs, say):
        replace_dirs(list(work.outputs.items()))  # both trees or neither
        if digest is not None:
            stamp.record(settings.cache_dir, digest, outputs_dirs)
    say("wrote " + ", ".join(f"{len(files)} files to {where}"
                             for where, files in work.outputs.items()))
    modules = sorted({b.module.group for b in work.builds})
    fresh = work.compiled_units
    if args.json:
        print(json.dumps({"modules": modules, "kernels": sorted(work.compiled),
                          "compiled": sorted(fresh)}, indent=2))
    else:
        print(f"built {len(work.own_kernels)} kernels in {len(modules)} modules "
              f"({len(fresh)} compiled, {len(work.builds) - len(fresh)} from the store)")
    return 0


def _spec_kernels(settings: Settings, args) -> set[str]:
    """The kernels the spec directory defines."""
    return {k.name for k in _kernels(settings, args)}


def _unknown(names: list[str], known: set[str], what: str) -> None:
    """KgenError naming the first of ``names`` not in ``known``, with a guess."""
    from kgen.compiler.spec.resolve import did_you_mean

    for name in names:
        if name not in known:
            raise KgenError(f"unknown kernel '{name}' ({what})"
                            + did_you_mean(name, sorted(known)))


def cmd_verify(args, settings: Settings, say: Reporter) -> int:
    from kgen.compiler import pipeline
    from kgen.compiler.golden import load_golden
    from kgen.compiler.verify import sass_diff, summary, table

    golden = load_golden(settings.golden)
    known = set(golden.ptx) | set(golden.frozen) | _spec_kernels(settings, args)
    _unknown(list(args.kernels) + ([args.diff] if args.diff else []), known,
             f"not in golden/ nor in {settings.specs}")
    if args.diff and args.diff not in golden.ptx:
        raise KgenError(f"--diff {args.diff}: only the reference's kernels keep a SASS listing "
                        "in golden/ (a frozen kernel keeps digests)")
    ctx = _context(settings, args, say)
    made_with = golden.manifest.get("toolchain", {})
    if made_with and made_with != dict(ctx.toolchain.versions):
        # Another ptxas can schedule differently: differences would not be kgen's.
        print(f"kgen: warning: golden/ was made with {made_with}, verifying with "
              f"{dict(ctx.toolchain.versions)}; regenerate it with `kgen golden`",
              file=sys.stderr)
    if args.diff:
        work = pipeline.run(pipeline.VERIFY[:-1], pipeline.Work(inputs=(settings.specs,),
                                                                golden=golden), ctx)
        name, compiled = args.diff, work.compiled
        if name not in compiled:
            raise KgenError(f"--diff {name}: no spec in {settings.specs} defines this kernel")
        same = [i.word for i in golden.sass[name]] == [i.word for i in compiled[name].sass]
        lines = sass_diff(golden.sass[name], compiled[name].sass, context=None)
        if args.json:
            print(json.dumps({"kernel": name, "identical": same, "diff": list(lines)}))
        else:
            print("\n".join(lines))
        return 0 if same else 1
    work = pipeline.run(pipeline.VERIFY, pipeline.Work(inputs=(settings.specs,), golden=golden,
                                                       wanted=tuple(args.kernels)), ctx)
    verdicts = work.verdicts
    if args.json:
        print(json.dumps([v.__dict__ for v in verdicts], indent=2))
    else:
        if not args.quiet:  # --quiet: the summary and what failed, not the table
            print(table(verdicts))
        for v in verdicts:
            if v.status in ("different", "new") and v.detail:
                if v.status == "new" and args.allow_new:
                    continue
                print(f"\n{v.name} ({v.module}, {v.status}): {v.detail}")
        print(summary(verdicts))
    counted = [v for v in verdicts if v.status != "new" or not args.allow_new]
    return 0 if all(v.ok for v in counted) else 1


def cmd_freeze(args, settings: Settings, say: Reporter) -> int:
    """Snapshot the generated kernels beyond the reference into golden/frozen.json."""
    from kgen.compiler import pipeline
    from kgen.compiler.golden import FROZEN_FILE, frozen_file, load_golden, snapshot

    golden = load_golden(settings.golden)
    _unknown(list(args.kernels), _spec_kernels(settings, args) | set(golden.frozen),
             f"not in {settings.specs}")
    ctx = _context(settings, args, say)
    compiled = pipeline.run(pipeline.VERIFY[:-1], pipeline.Work(inputs=(settings.specs,),
                                                                golden=golden), ctx).compiled
    beyond = {n: c for n, c in compiled.items() if n not in golden.ptx}
    reference = [n for n in args.kernels if n in golden.ptx]
    if reference:
        raise KgenError(f"{', '.join(reference)}: a reference kernel is verified against "
                        "golden/ itself, not frozen")
    if args.kernels:
        frozen = dict(golden.frozen)
        for n in args.kernels:
            if n in beyond:
                frozen[n] = snapshot(beyond[n])
            else:
                frozen.pop(n, None)  # no longer generated: unfrozen
    else:
        frozen = {n: snapshot(c) for n, c in sorted(beyond.items())}
    old = golden.frozen
    added = sorted(set(frozen) - set(old))
    removed = sorted(set(old) - set(frozen))
    changed = sorted(n for n in set(frozen) & set(old) if frozen[n] != old[n])
    path = settings.golden / FROZEN_FILE
    tmp = path.with_name(f".{FROZEN_FILE}.{os.getpid()}.tmp")
    tmp.write_bytes(frozen_file(frozen, dict(ctx.toolchain.versions)))
    os.replace(tmp, path)
    if args.json:
        print(json.dumps({"frozen": len(frozen), "added": added, "changed": changed,
                          "removed": removed}, indent=2))
    else:
        for label, names in (("added", added), ("changed", changed), ("removed", removed)):
            if names:
                print(f"{label}: {', '.join(names)}")
        print(f"froze {len(frozen)} kernels into {path} ({len(added)} added, {len(changed)} "
              f"changed, {len(removed)} removed); review and commit it")
    return 0


def cmd_golden(args, settings: Settings, say: Reporter) -> int:
    from dataclasses import replace

    from kgen.compiler import pipeline
    from kgen.compiler.atomic import replace_dir
    from kgen.compiler.golden import golden_kernels

    if args.reference:
        settings = replace(settings, reference=Path(args.reference))
    work = pipeline.run(pipeline.GOLDEN, pipeline.Work(), _context(settings, args, say))
    files = work.outputs[settings.golden]
    from kgen.compiler.golden import FROZEN_FILE

    replace_dir(settings.golden, dict(files), keep=(FROZEN_FILE,))  # the snapshot stays
    print(f"golden: {len(golden_kernels(files))} kernels from {settings.reference} -> "
          f"{settings.golden}")
    return 0


def _spec_errors(inputs: tuple[Path, ...], settings: Settings, args):
    """Every spec file of ``inputs`` that does not check, one error each: the set is
    checked, the file of its error is set aside and the rest checked again, until the
    rest checks (a file set aside still gives its definitions to the files beside it,
    where it parses). The work of the last round that checked, or None."""
    from kgen.compiler import pipeline
    from kgen.compiler.spec.files import spec_paths

    ctx = _context(settings, args)
    left = [Path(os.path.realpath(p)) for p in spec_paths(list(inputs))]
    every = frozenset(left)
    errors: list[SpecError] = []
    while left:
        try:
            work = pipeline.Work(inputs=tuple(left), aside=every - set(left))
            return pipeline.run(pipeline.CHECK, work, ctx), errors
        except SpecError as exc:
            if getattr(args, "debug", False) or (errors and any(
                    e.pos.path in exc.message for e in errors)):
                # --debug: the first, with its traceback; an error that points at a file
                # set aside (a name it defines too) is that file's, said already.
                if not errors:
                    raise
                return None, errors
            where = {Path(os.path.realpath(settings.root / exc.pos.path)),
                     Path(os.path.realpath(exc.pos.path))}
            rest = [p for p in left if p not in where]
            if len(rest) == len(left):  # in a file set aside (read as context) or none
                #                         named: said already, or no further round helps
                return None, errors or [exc]
            errors.append(exc)
            left = rest
    return None, errors


def _said(e: SpecError) -> dict:
    """A spec error as ``--json`` says it: its place and message, and its notes' (where
    it has any)."""
    notes = [{"path": n.pos.path, "line": n.pos.line, "col": n.pos.col, "message": n.message}
             for n in e.notes]
    return {"path": e.pos.path, "line": e.pos.line, "col": e.pos.col, "message": e.message,
            **({"notes": notes} if notes else {})}


def cmd_check(args, settings: Settings, say: Reporter) -> int:
    """Check the named files against the specs beside them (their whole set, as the
    directory's check does; only the definitions they need where the files beside are
    no set). Every file that does not check is reported, each with its first error."""
    inputs = _inputs(settings, args.specs)
    work, errors = _spec_errors(inputs, settings, args)
    if errors:
        if args.json:  # the first as every --json error has it, then each
            said = [_said(e) for e in errors]
            print(json.dumps({"error": said[0], "errors": said}))
        for e in errors:
            print(e.render(), file=sys.stderr)
        if len(errors) > 1:
            print(f"kgen: {len(errors)} spec files do not check", file=sys.stderr)
        return SpecError.exit_code
    mine = {f.path for f in work.files}
    count = sum(k.spec_path in mine for k in work.kernels)
    extra = len(work.context)
    if args.json:
        print(json.dumps({"ok": True, "spec_files": [f.path for f in work.files],
                          "kernels": [k.name for k in work.kernels if k.spec_path in mine],
                          "context_files": [f.path for f in work.context]}, indent=2))
        return 0
    note = (f" (definitions from {extra} other spec file{'s' if extra != 1 else ''})"
            if extra else "")
    print(f"ok: {len(work.files)} spec files, {count} kernels{note}")
    return 0


def _resources(settings: Settings, args) -> dict[str, dict]:
    """ptxas's report of every spec kernel, through the store."""
    from kgen.compiler import pipeline

    work = pipeline.run(("parse", "context", "check", "render", "ptx", "cubin"),
                        pipeline.Work(inputs=(settings.specs,)), _context(settings, args))
    return {n: c.resources.as_dict() for n, c in work.compiled.items()}


def _listed(kernels, args) -> list:
    """The kernels ``kgen list``'s filters keep: a name pattern (a regular expression
    searched in the name), --op, --kv (K's or V's format) and --head-dim (launches at
    that head_dim with one group)."""
    from kgen.errors import did_you_mean
    from kgen.formats import FORMATS
    from kgen.ir.axes import Op
    from kgen.runtime.bind import shape_refusal

    for flag, given, known in (("--op", args.op, [o.value for o in Op]),
                               ("--kv", args.kv, list(FORMATS))):
        for name in given:
            if name not in known:
                raise UsageError(f"kgen list {flag}: unknown '{name}'"
                                 + (did_you_mean(name, known) or f" (one of {', '.join(known)})"))
    try:
        pattern = re.compile(args.pattern or "")
    except re.error as e:
        raise UsageError(f"kgen list: the pattern {args.pattern!r} is not a regular "
                         f"expression: {e}") from None
    out = []
    for k in kernels:
        if not pattern.search(k.name):
            continue
        if args.op and k.op.value not in args.op:
            continue
        if args.kv and not ({k.kv.value, k.v_kv.value} & set(args.kv)):
            continue
        if args.head_dim and any(shape_refusal(k, hd, 1) is not None for hd in args.head_dim):
            continue
        out.append(k)
    return out


def cmd_list(args, settings: Settings, say: Reporter) -> int:
    """The spec kernels, one line each (or --json). The head_dims each launches at are
    worked out on request (--coverage; --json always has them): every head_dim up to a
    block's limit is tried against the launch contracts, seconds for the whole set."""
    from kgen import ops
    from kgen.compiler import coverage
    from kgen.runtime.record import axes_of

    kernels = _listed(_kernels(settings, args), args)
    if args.json:
        res = _resources(settings, args) if args.resources else {}
        print(json.dumps([{"name": k.name, "axes": axes_of(k),
                           **coverage.limits(k, res.get(k.name))} for k in kernels], indent=1))
        return 0
    if not kernels:
        say("no kernel matches")
        return 0
    w = max(len(k.name) for k in kernels)
    for k in kernels:
        axes = ops.get(k.op).describe(k)
        dims = f"  head_dim {coverage.runs(coverage.head_dims(k))}" if args.coverage else ""
        print(f"{k.name:<{w}}  {k.module:<14}  {axes}{dims}")
    return 0


def cmd_tune(args, settings: Settings, say: Reporter) -> int:
    """Needs a GPU: search decode plans and variants and prefill variants, check each,
    store the fastest."""
    from kgen.formats import FORMATS
    from kgen.tune import search as tune

    kvs = [x for x in args.kv.split(",") if x] or list(FORMATS)
    unknown = [kv for kv in kvs if kv not in FORMATS]
    if unknown:
        raise UsageError(f"--kv {','.join(unknown)}: no such format (registered: "
                        f"{', '.join(FORMATS)})")
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as exc:  # ImportError, a CUDA library that fails to load, no device
        raise KgenError(f"kgen tune times kernels on a GPU: {type(exc).__name__}: {exc} "
                        "(install the CuPy extra for this driver, see `kgen doctor`)") from None
    tune.main(kvs, args.head_dim, args.groups, args.contexts, say=print,
              prefill_rows=args.prefill_rows)
    return 0


def cmd_show(args, settings: Settings, say: Reporter) -> int:
    from kgen.ir.axes import KEYS

    by = {k.name: k for k in _kernels(settings, args)}
    _unknown([args.kernel], set(by), f"no spec in {settings.specs} defines it")
    k = by[args.kernel]
    if args.arch and not args.sass:
        raise UsageError("--arch picks the GPU of --sass's listing: give --sass too")
    if args.sass:
        return _show_sass(k.name, settings, args)
    if args.json:
        keys = {}
        for key, spec in KEYS.items():
            if spec.ops is None or k.op in spec.ops:
                val = getattr(k, key)
                keys[key] = {"value": getattr(val, "value", val),
                             "from": str(k.where(key)) if key in k.explicit_keys else "default"}
        print(json.dumps({
            "name": k.name, "lineage": list(k.lineage), "spec": str(k.pos), "keys": keys,
            "budgets": [{"resource": b.resource, "op": b.op, "value": b.value,
                         "from": str(b.pos)} for b in k.budgets],
            "relations": [{"kind": r.kind, "other": r.other, "tolerance": r.tolerance,
                           "from": str(r.pos)} for r in k.relations],
        }, indent=2))
        return 0
    print(f"{k.name}  ({' <- '.join(k.lineage)})")
    for key, spec in KEYS.items():
        if spec.ops is not None and k.op not in spec.ops:
            continue
        val = getattr(k, key)
        val = getattr(val, "value", val)
        src = f"  [{k.where(key)}]" if key in k.explicit_keys else "  [default]"
        print(f"  {key:<15} = {val!s:<24}{src}")
    for b in k.budgets:
        print(f"  expect {b.resource} {b.op} {b.value}")
    for r in k.relations:
        tol = f" within {r.tolerance:g}" if r.kind == "close_to" else ""
        print(f"  expect {r.kind} {'with ' if r.kind == 'bit_exact' else ''}{r.other}{tol}")
    return 0


def _show_sass(name: str, settings: Settings, args) -> int:
    """The kernel's sm_37 instruction mix: the whole kernel, then each loop (a branch
    back), innermost ones marked; an issue-bound loop shows its FMA share here. With
    --arch, the mix and ptxas's resources of the same PTX compiled for that GPU (what a
    driver's JIT runs there, as this toolchain's ptxas compiles it)."""
    from dataclasses import replace

    from kgen.compiler import pipeline
    from kgen.toolchain import compile as tool
    from kgen.toolchain import resources
    from kgen.toolchain import sass_listing as sl
    from kgen.toolchain.locate import TARGET_ARCH

    ctx = _context(settings, args)
    work = pipeline.run(("parse", "context", "check", "render"),
                        pipeline.Work(inputs=(settings.specs,)), ctx)
    # Only the kernel's own unit goes on to the compilers (or the store).
    work = replace(work, modules=tuple(m for m in work.modules
                                       if name in {k.name for k in m.kernels}))
    arch = args.arch or TARGET_ARCH
    if arch != TARGET_ARCH:  # one the toolchain's ptxas compiles, at or past the PTX's target
        archs = ctx.toolchain.run([ctx.toolchain.nvcc, "--list-gpu-code"]).stdout.split()
        newer = [a for a in archs if a.startswith("sm_") and int(a[3:]) >= int(TARGET_ARCH[3:])]
        if arch not in newer:
            raise UsageError(f"--arch {arch}: this toolchain's ptxas compiles the {TARGET_ARCH} "
                             f"PTX for {', '.join(newer)}")
    work = pipeline.run(("ptx", "cubin"), work, ctx)
    if arch == TARGET_ARCH:
        stream, res = work.compiled[name].sass, work.compiled[name].resources
    else:
        b = next(b for b in work.builds if name in {k.name for k in b.module.kernels})
        cub = tool.cubin(b.ptx, ctx.toolchain, ctx.cache, name=b.module.name, arch=arch)
        stream = sl.parse(tool.sass(cub.data, ctx.toolchain, ctx.cache,
                                    name=b.module.name))[name]
        res = resources.parse(cub.ptxas_log)[name]
    out = sl.profile(stream)
    if args.json:
        print(json.dumps({"name": name, "target": arch, "resources": res.as_dict(),
                          "parts": out}, indent=1))
        return 0
    print(f"{name}: {arch} SASS, instructions by opcode ({res.registers} registers, "
          f"{res.stack_frame} bytes stack, {res.spill_stores} bytes spill stores)")
    for r in out:
        share = 100 * r["ffma"] / r["instructions"] if r["instructions"] else 0.0
        top = ", ".join(f"{op} {n}" for op, n in list(r["mix"].items())[:10])
        print(f"  {r['what']:<34} {r['instructions']:6d}  FFMA {share:4.1f}%  {top}")
    return 0


def cmd_doctor(args, settings: Settings, say: Reporter) -> int:
    """GPU, driver, CuPy, which image each generated module loads, the toolchain."""
    from kgen import doctor

    r = doctor.report(settings)
    print(doctor.as_json(r) if args.json else doctor.as_text(r))
    return r.exit_code


def cmd_dist(args, settings: Settings, say: Reporter) -> int:
    """A wheel of kgen with the built kernels, for hosts without the toolchain."""
    from kgen.compiler import dist
    from kgen.runtime.manifest import ManifestError

    try:
        path = dist.wheel(settings, Path(args.out))
    except ManifestError as exc:
        raise KgenError(f"{exc}; run `kgen build specs/` first") from None
    print(json.dumps({"wheel": str(path)}) if args.json else f"wrote {path}")
    return 0


MAX_JOBS = 1024


def _jobs(text: str) -> int:
    """``-j N``: a positive count of parallel compiles (without -j: one per CPU)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if not 1 <= n <= MAX_JOBS:
        raise argparse.ArgumentTypeError(f"{n} is not in 1..{MAX_JOBS} (leave -j out for one "
                                         "compile per CPU)")
    return n


def _sm_arch(text: str) -> str:
    """A GPU architecture as ptxas names it (``sm_61``, ``sm_90``)."""
    if not re.fullmatch(r"sm_\d{2,3}", text):
        raise argparse.ArgumentTypeError(f"'{text}' is not a GPU architecture like sm_61 "
                                         "or sm_90")
    return text


def _names(text: str) -> list[str]:
    """A comma-separated list of names (``f16,q8_0``)."""
    out = [p.strip() for p in text.split(",") if p.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected at least one name")
    return out


def _positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive integers (``128,256``)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(f"'{part}' is not a positive whole number "
                                             "(expected a comma-separated list like 128,256)")
        out.append(int(part))
    if not out:
        raise argparse.ArgumentTypeError("expected at least one value")
    return out


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kgen", description=__doc__)
    p.add_argument("--version", action="version", version=f"kgen {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks")
    common.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    common.add_argument("--json", action="store_true", help="machine-readable summary")
    common.add_argument("--no-cache", action="store_true", help="ignore the artifact cache")
    common.add_argument("-j", "--jobs", type=_jobs, default=0,
                        help="parallel compiles (default: one per CPU)")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", parents=[common], help="render and compile specs into generated/")
    b.add_argument("specs", nargs="*", help="spec files or directories (default: specs/)")
    b.add_argument("-o", "--out", metavar="DIR", default=None,
                   help="write the tree of the named specs' kernels to DIR (default: the "
                   "generated setting, generated/)")
    b.set_defaults(fn=cmd_build)
    v = sub.add_parser("verify", parents=[common],
                       help="compile the specs (through the store), compare with golden/")
    v.add_argument("kernels", nargs="*")
    v.add_argument("--diff", metavar="KERNEL", help="print the whole aligned SASS diff")
    v.add_argument("--allow-new", action="store_true",
                   help="do not fail on generated kernels with no golden and no frozen "
                   "snapshot")
    v.set_defaults(fn=cmd_verify)
    f = sub.add_parser("freeze", parents=[common],
                       help="snapshot generated kernels beyond the reference into "
                       "golden/frozen.json")
    f.add_argument("kernels", nargs="*", help="only these (default: every one, and drop "
                   "snapshots of kernels no longer generated)")
    f.set_defaults(fn=cmd_freeze)
    g = sub.add_parser("golden", parents=[common], help="compile the reference into golden/")
    g.add_argument("--reference", help="reference .cu (default: the setting)")
    g.set_defaults(fn=cmd_golden)
    c = sub.add_parser("check", parents=[common], help="validate specs without building")
    c.add_argument("specs", nargs="*")
    c.set_defaults(fn=cmd_check)
    li = sub.add_parser("list", parents=[common], help="list kernels")
    li.add_argument("pattern", nargs="?", default="",
                    help="only kernels whose name this regular expression finds")
    li.add_argument("--op", type=_names, default=[], help="only these ops (comma-separated)")
    li.add_argument("--kv", type=_names, default=[],
                    help="only kernels over these KV formats (K or V; comma-separated)")
    li.add_argument("--head-dim", type=_positive_ints, default=[],
                    help="only kernels that launch at these head_dims (comma-separated)")
    li.add_argument("--coverage", action="store_true",
                    help="each kernel's head_dims (every head_dim tried: seconds)")
    li.add_argument("--resources", action="store_true",
                    help="with --json: each kernel's ptxas resources and sm_37 occupancy "
                    "(compiles what the store lacks)")
    li.set_defaults(fn=cmd_list)
    t = sub.add_parser("tune", parents=[common],
                       help="on a GPU: choose decode plans and variants per shape class")
    t.add_argument("--kv", default="", help="formats (comma-separated; default: every "
                   "registered format)")
    t.add_argument("--head-dim", default="128,256", type=_positive_ints,
                   help="head dims (comma-separated)")
    t.add_argument("--groups", default="8", type=_positive_ints,
                   help="q heads per kv head (comma-separated)")
    t.add_argument("--contexts", default="4096,32768", type=_positive_ints,
                   help="context lengths, one shape class each (comma-separated)")
    t.add_argument("--prefill-rows", default="128,2048", type=_positive_ints,
                   help="prefill batch rows, one shape class each (comma-separated)")
    t.set_defaults(fn=cmd_tune)
    s = sub.add_parser("show", parents=[common], help="one kernel's resolved axes")
    s.add_argument("kernel")
    s.add_argument("--sass", action="store_true",
                   help="its sm_37 SASS instead: the instruction mix of the kernel and of "
                        "each loop, and ptxas's resources (compiles what the store lacks)")
    s.add_argument("--arch", type=_sm_arch, default=None,
                   help="with --sass: the same PTX compiled for this GPU instead (e.g. "
                        "sm_61 for a P40, sm_90 for an H100/H200: what a driver's JIT "
                        "runs there, as this toolchain's ptxas compiles it)")
    s.set_defaults(fn=cmd_show)
    sub.add_parser("doctor", parents=[common], help="what this machine can build and run, "
                   "and why").set_defaults(fn=cmd_doctor)
    d = sub.add_parser("dist", parents=[common], help="a wheel of kgen with the built kernels")
    d.add_argument("-o", "--out", default="dist", help="where the wheel goes (default: dist/)")
    d.set_defaults(fn=cmd_dist)
    return p


class _ArgumentError(Exception):
    """argparse's refusal of the command line (its message, the usage of the parser)."""

    def __init__(self, message: str, usage: str):
        super().__init__(message)
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    """argparse, raising its refusals (main says them: as JSON too under --json)."""

    def error(self, message: str):
        raise _ArgumentError(message, self.format_usage())


def _json_error(message: str, exit_code: int) -> None:
    """The one JSON object a failing ``--json`` call prints on stdout."""
    print(json.dumps({"error": {"message": message, "exit_code": exit_code}}))


def _unknown_command(argv: list[str], p: argparse.ArgumentParser) -> int | None:
    """``kgen buld``: exit 2 naming the closest command, before argparse's list."""
    from kgen.errors import did_you_mean

    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is None or first in sub.choices:
        return None
    message = f"unknown command '{first}'" + (did_you_mean(first, sorted(sub.choices)) or
                                              f" (commands: {', '.join(sub.choices)})")
    if "--json" in argv:
        _json_error(message, 2)
    print(f"kgen: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    p = parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    bad = _unknown_command(argv, p)
    if bad is not None:
        return bad
    try:
        args = p.parse_args(argv)
    except _ArgumentError as exc:  # as argparse says it, and as JSON under --json
        if "--json" in argv:
            _json_error(str(exc), 2)
        print(f"{exc.usage}kgen: error: {exc}", file=sys.stderr, end="\n")
        return 2
    say = Reporter(args.quiet, args.json)
    try:
        settings = Settings.load()
        cache = settings.cache_dir
        if cache.exists() and not cache.is_dir():
            raise KgenError(f"the cache directory {cache} (KGEN_CACHE_DIR, or "
                            "~/.cache/kgen) is not a directory")
        return args.fn(args, settings, say)
    except SpecError as exc:
        if args.debug:
            traceback.print_exc()
        if args.json:
            print(json.dumps({"error": _said(exc)}))
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    except KgenError as exc:
        if args.debug:
            traceback.print_exc()
        if args.json:
            print(json.dumps({"error": {"message": str(exc), "exit_code": exc.exit_code}}))
        print(f"kgen: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return 0
    except OSError as exc:
        # The environment, not kgen: an unwritable output, a full disk, a name too long.
        if args.debug:
            traceback.print_exc()
        where = f"{exc.filename}: " if exc.filename else ""
        if args.json:
            _json_error(f"{where}{exc.strerror or exc}", 1)
        print(f"kgen: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.json:
            _json_error("interrupted", 130)
        print("kgen: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        if type(exc).__module__.split(".")[0] == "jinja2":
            # A template bug is the user's input, not kgen's: say where it is.
            where = f"{getattr(exc, 'filename', None) or getattr(exc, 'name', '')}"
            line = getattr(exc, "lineno", None)
            said = f"template {where}{f':{line}' if line else ''}: {type(exc).__name__}: {exc}"
            if args.json:
                _json_error(said, 2)
            print(f"kgen: error: {said}", file=sys.stderr)
            return 2
        if args.json:
            _json_error(f"internal error: {type(exc).__name__}: {exc}", 70)
        traceback.print_exc()
        print(f"kgen: internal error: {type(exc).__name__}: {exc} (a kgen bug; the traceback "
              "is above)", file=sys.stderr)
        return 70
