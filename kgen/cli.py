"""``kgen``: build, verify, golden, check, list, show."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from kgen import __version__
from kgen.cache import Cache
from kgen.config import Settings
from kgen.errors import KgenError, SpecError
from kgen.toolchain import find_toolchain

# The compiler stages (lark, jinja2, numpy) are imported by the commands that
# run them, so a no-op `kgen build` answers without loading them.


class Reporter:
    """Progress on stderr (a terminal unless --quiet); results on stdout."""

    def __init__(self, quiet: bool, as_json: bool):
        self.quiet = quiet or as_json
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:6.2f}s] {msg}", file=sys.stderr, flush=True)


def _cache(settings: Settings, args) -> Cache:
    return Cache(settings.cache_dir, enabled=not getattr(args, "no_cache", False))


def _kernels(settings: Settings, inputs: list[str] | None):
    from kgen import pipeline

    paths = [Path(p) for p in inputs] if inputs else [settings.specs]
    files = pipeline.parse(paths, settings.root)
    return files, pipeline.checked(files)


def _spec_files(settings: Settings, inputs: list[str] | None) -> list[Path]:
    from kgen.spec.files import spec_paths

    return spec_paths([Path(p) for p in inputs] if inputs else [settings.specs])


def cmd_build(args, settings: Settings, say: Reporter) -> int:
    from kgen import stamp

    outputs_dirs = [settings.generated, settings.tests_generated]
    digest = None
    if not args.check and not args.no_cache:
        try:
            spec_files = _spec_files(settings, args.specs)
            digest = stamp.input_digest(spec_files, settings.templates)
        except OSError:
            digest = None  # an unreadable input: the full build reports it properly
    if digest is not None and stamp.is_fresh(settings.cache_dir, digest, outputs_dirs):
        if args.json:
            print(json.dumps({"up_to_date": True}))
        else:
            print("up to date (inputs and outputs unchanged)")
        return 0
    from kgen import pipeline
    from kgen.atomic import read_tree, replace_dirs
    from kgen.render import render_modules, render_tests

    files, kernels = _kernels(settings, args.specs)
    say(f"parse+check {len(files)} spec files, {len(kernels)} kernels")
    modules = render_modules(kernels, settings.templates, settings.root)
    say(f"render {len(modules)} modules")
    tc = find_toolchain()
    builds = pipeline.compile_modules(modules, tc, _cache(settings, args), args.jobs, say)
    compiled = {n: c for b in builds for n, c in b.kernels().items()}
    pipeline.check_budgets(kernels, compiled, {f.path: f.lines for f in files})
    files_out = pipeline.generated_files(builds, settings.templates, settings.root)
    tests_out = {n: t.encode() for n, t in
                 render_tests([b.module for b in builds], settings.templates,
                              settings.root).items()}
    outputs = ((settings.generated, files_out), (settings.tests_generated, tests_out))
    if args.check:
        stale = []
        for where, files in outputs:
            current = read_tree(where)
            stale += [str(where / n) for n in sorted(set(files) | set(current))
                      if files.get(n) != current.get(n)]
        if stale:
            print("generated files are stale; run `kgen build specs/` and commit:\n  "
                  + "\n  ".join(stale))
            return 1
        print(f"generated files are up to date ({len(files_out) + len(tests_out)} files)")
        return 0
    replace_dirs(list(outputs))  # both trees or neither
    say(f"wrote {len(files_out)} files to {settings.generated}, {len(tests_out)} tests to "
        f"{settings.tests_generated}")
    if digest is not None:
        stamp.record(settings.cache_dir, digest, outputs_dirs)
    if args.json:
        print(json.dumps({"modules": [b.module.name for b in builds],
                          "kernels": sorted(compiled)}, indent=2))
    else:
        print(f"built {len(kernels)} kernels in {len(modules)} modules")
    return 0


def cmd_verify(args, settings: Settings, say: Reporter) -> int:
    from kgen import pipeline
    from kgen.golden import load_golden
    from kgen.verify import compare, sass_diff, summary, table

    golden = load_golden(settings.golden)
    modules = pipeline.read_generated_modules(settings.generated)
    tc = find_toolchain()
    made_with = golden.manifest.get("toolchain", {})
    if made_with and made_with != dict(tc.versions):
        # Another ptxas can schedule differently: differences would not be kgen's.
        print(f"kgen: warning: golden/ was made with {made_with}, verifying with "
              f"{dict(tc.versions)}; regenerate it with `kgen golden`", file=sys.stderr)
    builds = pipeline.compile_modules(modules, tc, _cache(settings, args), args.jobs, say)
    compiled = {n: c for b in builds for n, c in b.kernels().items()}
    if args.diff:
        name = args.diff
        if name not in golden.ptx or name not in compiled:
            raise KgenError(f"--diff {name}: needs a kernel both golden and generated")
        print("\n".join(sass_diff(golden.sass[name], compiled[name].sass, context=None)))
        return 0 if [i.word for i in golden.sass[name]] == [
            i.word for i in compiled[name].sass] else 1
    only = args.kernels or None
    unknown = [n for n in (only or []) if n not in golden.ptx and n not in compiled]
    if unknown:
        raise KgenError("unknown kernel(s): " + ", ".join(unknown))
    names = only or sorted(set(golden.kernels) | set(compiled))
    verdicts = compare(golden, compiled, names)
    if args.json:
        print(json.dumps([v.__dict__ for v in verdicts], indent=2))
    else:
        print(table(verdicts))
        for v in verdicts:
            if v.status == "different":
                print(f"\n{v.name} ({v.module}): {v.detail}")
        print(summary(verdicts))
    counted = [v for v in verdicts if v.status != "new"]
    return 0 if all(v.ok for v in counted) else 1


def cmd_golden(args, settings: Settings, say: Reporter) -> int:
    from kgen.golden import make_golden

    ref = Path(args.reference) if args.reference else settings.reference
    names = make_golden(ref, settings.golden, find_toolchain(), _cache(settings, args))
    print(f"golden: {len(names)} kernels from {ref} -> {settings.golden}")
    return 0


def cmd_check(args, settings: Settings, say: Reporter) -> int:
    """Check the named files; definitions they inherit from other specs beside
    them are read as context."""
    from kgen import pipeline

    paths = [Path(p) for p in args.specs] if args.specs else [settings.specs]
    files = pipeline.parse(paths, settings.root)
    context = pipeline.with_parents(files, settings.root)
    kernels = pipeline.checked(context)
    mine = {f.path for f in files}
    count = sum(k.spec_path in mine for k in kernels)
    extra = len(context) - len(files)
    note = f" (parents from {extra} other spec file{'s' if extra != 1 else ''})" if extra else ""
    print(f"ok: {len(files)} spec files, {count} kernels{note}")
    return 0


def cmd_list(args, settings: Settings, say: Reporter) -> int:
    _, kernels = _kernels(settings, None)
    w = max(len(k.name) for k in kernels)
    for k in kernels:
        axes = f"{k.op.value}"
        if k.op.value == "flash":
            axes += f" {k.mode.value} pos={k.position.value} kv={k.kv.value} " \
                    f"q={k.q_stage.value} k={k.k_stage.value} v={k.v_stage.value}"
        elif k.op.value in ("kv_append", "decode_combine"):
            axes += f" pos={k.position.value}" + (f" kv={k.kv.value}" if k.op.value ==
                                                  "kv_append" else "")
        print(f"{k.name:<{w}}  {k.module:<12}  {axes}")
    return 0


def cmd_show(args, settings: Settings, say: Reporter) -> int:
    from kgen.spec.axes import KEYS

    _, kernels = _kernels(settings, None)
    by = {k.name: k for k in kernels}
    k = by.get(args.kernel)
    if k is None:
        raise KgenError(f"no kernel '{args.kernel}'")
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kgen", description=__doc__)
    p.add_argument("--version", action="version", version=f"kgen {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks")
    common.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    common.add_argument("--json", action="store_true", help="machine-readable summary")
    common.add_argument("--no-cache", action="store_true", help="ignore the artifact cache")
    common.add_argument("-j", "--jobs", type=int, default=0, help="parallel compiles")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", parents=[common], help="render and compile specs into generated/")
    b.add_argument("specs", nargs="*", help="spec files or directories (default: specs/)")
    b.add_argument("--check", action="store_true",
                   help="do not write; fail if generated/ differs from a fresh build")
    b.set_defaults(fn=cmd_build)
    v = sub.add_parser("verify", parents=[common], help="compare generated/ with golden/")
    v.add_argument("kernels", nargs="*")
    v.add_argument("--diff", metavar="KERNEL", help="print the whole aligned SASS diff")
    v.set_defaults(fn=cmd_verify)
    g = sub.add_parser("golden", parents=[common], help="compile the reference into golden/")
    g.add_argument("--reference", help="reference .cu (default: the setting)")
    g.set_defaults(fn=cmd_golden)
    c = sub.add_parser("check", parents=[common], help="validate specs without building")
    c.add_argument("specs", nargs="*")
    c.set_defaults(fn=cmd_check)
    sub.add_parser("list", parents=[common], help="list kernels").set_defaults(fn=cmd_list)
    s = sub.add_parser("show", parents=[common], help="one kernel's resolved axes")
    s.add_argument("kernel")
    s.set_defaults(fn=cmd_show)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    settings = Settings.load()
    say = Reporter(args.quiet, args.json)
    try:
        return args.fn(args, settings, say)
    except SpecError as exc:
        if args.debug:
            traceback.print_exc()
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    except KgenError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"kgen: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("kgen: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        if type(exc).__module__.split(".")[0] == "jinja2":
            # A template bug is the user's input, not kgen's: say where it is.
            where = f"{getattr(exc, 'filename', None) or getattr(exc, 'name', '')}"
            line = getattr(exc, "lineno", None)
            print(f"kgen: error: template {where}{f':{line}' if line else ''}: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        traceback.print_exc()
        print(f"kgen: internal error: {type(exc).__name__}: {exc} (a kgen bug; the traceback "
              "is above)", file=sys.stderr)
        return 70
