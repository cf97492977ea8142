"""Names kernels and modules may not take: the list kgen checks against is the
one the generated code actually uses, and the generated code survives any doc."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kgen.compiler import pipeline
from kgen.compiler.spec.names import GENERATED_PY_NAMES, kernel_name_problem, module_name_problem
from kgen.compiler.spec.parser import parse_spec
from kgen.ops import py_args
from kgen.runtime.kernels import make_launcher
from kgen.runtime.manifest import Arg, Entry
from kgen.runtime.record import axes_of
from kgen.testing.built import BUILT, needs_build

ROOT = Path(__file__).resolve().parents[2]


def _global_names(tree: ast.Module) -> set[str]:
    """Every name a generated file binds at module level or reads as a global."""
    local: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            local |= {a.arg for a in (*node.args.args, *node.args.kwonlyargs)}
            local |= {n.id for sub in node.body for n in ast.walk(sub)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Load) and n.id not in local}
    return names


@needs_build
def test_reserved_names_are_what_the_generated_code_uses():
    import kgen_kernels

    kernels, modules = set(BUILT.kernels), set(BUILT.modules)
    dunder = {n for n in vars(kgen_kernels) if n.startswith("__")}
    used = set(vars(kgen_kernels)) - dunder
    for mod in kgen_kernels.MODULES.values():
        used |= {n for n in vars(mod) if not n.startswith("__")}
    used -= kernels | modules | {"__all__"}
    assert used <= GENERATED_PY_NAMES, sorted(used - GENERATED_PY_NAMES)
    assert used >= GENERATED_PY_NAMES, "stale entries"


@pytest.mark.parametrize("name", ["def", "None", "lambda", "FATBINS", "KERNELS", "MANIFEST",
                                  "ROOT", "expose", "MODULES", "std", "cudaMalloc", "uint4",
                                  "size_t", "cudaStream_t", "ulonglong2", "int8_t",
                                  "int", "float", "return", "threadIdx", "printf", "_",
                                  "__x", "_Foo", "kgen_q4_quant_block", "WARP_SZ", "x" * 97,
                                  "NULL", "EOF", "INFINITY", "NAN", "INT_MAX", "FLT_MAX",
                                  "stdout", "errno", "offsetof", "assert", "min", "max",
                                  "CUDART_VERSION"])
def test_refused_kernel_names(name):
    assert kernel_name_problem(name) is not None


@pytest.mark.parametrize("name", ["fc_attn_flash_prefill", "_lower", "main", "add", "K2"])
def test_accepted_kernel_names(name):
    assert kernel_name_problem(name) is None


@pytest.mark.parametrize("name", ["class", "import", "__init__", "MODULES", "x" * 300, "NULL",
                                  "EOF"])
def test_refused_module_names(name):
    assert module_name_problem(name) is not None


def test_every_current_name_is_accepted():
    kernels = pipeline.checked(pipeline.parse([ROOT / "specs"], ROOT))
    assert not [k.name for k in kernels if kernel_name_problem(k.name)]
    assert not [k.module for k in kernels if module_name_problem(k.module)]


@pytest.mark.parametrize("doc", [r"C:\users", r"\N", "ends in \\", r"\x41 \u00e9 \\\\"])
def test_backslashes_in_doc_survive_the_generated_python(doc, tmp_path):
    spec = ('kernel fc_doc : fc_attn_kv_append {\n    module = attn_doc\n'
            f'    doc = "{doc}"\n}}\n')
    files = [*pipeline.parse([ROOT / "specs"], ROOT), parse_spec(spec, "doc.kspec")]
    kernels = [k for k in pipeline.checked(files) if k.module == "attn_doc"]
    (k,) = [k for k in kernels if k.name == "fc_doc"]
    arrays, scalars = py_args(k)
    entry = Entry("fc_doc", "attn_doc", "doc.kspec", k.doc, axes_of(k),
                  tuple(Arg(a.name, a.annotation, a.default, a.dtype) for a in arrays),
                  tuple(Arg(a.name, a.annotation, a.default, a.dtype) for a in scalars),
                  "kernels/fc_doc.fatbin", "", "src/fc_doc.cu", "", {})
    fn = make_launcher(entry, tmp_path / "fc_doc.fatbin", "kgen_kernels.attn_doc")
    assert fn.__doc__.startswith(doc[:1].upper() + doc[1:] + ".")
