"""The package layout, checked from the source: kgen's modules import each other
without a cycle, and the runtime imports only downward.

Every module under kgen/ is parsed (nothing is imported); every import counts,
at module level or inside a function, and ``from X import Y`` names the module
X.Y where Y is one. Both checks fail naming what they found.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "kgen"

# The layer rules: a module under a key must not import from any module under the
# packages (or modules) listed, except the ones named under "except".
FORBIDDEN = {
    "kgen.runtime": {
        "imports": ("kgen.compiler", "kgen.toolchain", "kgen.tune", "kgen.bench",
                    "kgen.testing", "kgen.numpy_ref", "kgen.cli", "kgen.doctor"),
        # loadcheck reads a fatbin's images and their ELF headers: pure readers.
        "except": ("kgen.toolchain.fatbin", "kgen.toolchain.elf"),
    },
    # The compiler makes kernels; testing, timing and tuning them sit above it.
    "kgen.compiler": {
        "imports": ("kgen.testing", "kgen.tune", "kgen.bench", "kgen.numpy_ref", "kgen.cli",
                    "kgen.doctor"),
        "except": (),
    },
}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module under ``root``, by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(files: dict[str, Path], name: str) -> bool:
    return name in files and files[name].name == "__init__.py"


def imports(name: str, tree: ast.AST, files: dict[str, Path]) -> set[str]:
    """The kgen modules ``name`` imports anywhere in ``tree``."""
    out: set[str] = set()
    package = name if _is_package(files, name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                sub = f"{src}.{a.name}"
                out.add(sub if sub in files else src)
    return {m for m in out if m in files and m != name}


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = module_files(root)
    return {name: imports(name, ast.parse(path.read_text(), str(path)), files)
            for name, path in files.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly
    connected component of more than one module, or of one importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(g):
        if v not in index:
            visit(v)
    out = []
    for comp in comps:
        start = min(comp)
        if len(comp) == 1 and start not in g.get(start, ()):
            continue
        out.append(_path(g, comp, start))
    return sorted(out)


def _path(g: dict[str, set[str]], comp: set[str], start: str) -> list[str]:
    """The shortest way round from ``start`` back to itself inside ``comp``."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g.get(v, ()) & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is not on a cycle")


def violations(g: dict[str, set[str]], rules: dict = FORBIDDEN) -> list[str]:
    out = []
    for layer, rule in rules.items():
        for src in sorted(m for m in g if _under(m, layer)):
            for dst in sorted(g[src]):
                if any(_under(dst, p) for p in rule["imports"]) and not any(
                        _under(dst, e) for e in rule.get("except", ())):
                    out.append(f"{src} imports {dst}")
    return out


@pytest.fixture(scope="module")
def kgen_graph() -> dict[str, set[str]]:
    return graph()


def test_no_import_cycles(kgen_graph):
    found = cycles(kgen_graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_runtime_imports_only_downward(kgen_graph):
    found = violations(kgen_graph)
    assert not found, "imports against the layer rules:\n" + "\n".join(found)


def test_the_graph_sees_every_kind_of_import(kgen_graph):
    """Function-level imports count, and ``from package import module`` names the module."""
    assert "kgen.runtime.launch" in kgen_graph["kgen.runtime.replay"]  # from kgen.runtime import
    assert "kgen.numpy_ref.attention" in kgen_graph["kgen.numpy_ref"]  # from .attention import
    assert "kgen.formats.q4" in kgen_graph["kgen.formats"]  # from kgen.formats import ..., q4
    assert "kgen.config" in kgen_graph["kgen.runtime.tuned"]  # inside cache_path


# ---- the checks themselves, on synthetic graphs and sources --------------------------------

def test_cycle_finder_names_each_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"g"},
         "g": {"f"}, "h": {"a"}}
    assert cycles(g) == [["a", "b", "c", "a"], ["e", "e"], ["f", "g", "f"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_layer_rules_flag_and_except():
    g = {"kgen.runtime.kv": {"kgen.tune.search", "kgen.ir.axes"},
         "kgen.runtime.loadcheck": {"kgen.toolchain.fatbin", "kgen.toolchain.compile"},
         "kgen.tune.search": {"kgen.runtime.kv"}}
    assert violations(g) == ["kgen.runtime.kv imports kgen.tune.search",
                             "kgen.runtime.loadcheck imports kgen.toolchain.compile"]


def test_imports_resolve_every_form(tmp_path):
    pkg = tmp_path / "kgen"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "top.py", "sub/__init__.py", "sub/a.py", "sub/b.py"):
        (pkg / f).write_text("")
    (pkg / "sub" / "a.py").write_text(
        "from . import b\nfrom .. import top\n\ndef f():\n    import kgen.sub\n")
    (pkg / "sub" / "b.py").write_text("from kgen.sub.a import f\n")
    g = graph(pkg)
    assert g["kgen.sub.a"] == {"kgen.sub.b", "kgen.top", "kgen.sub"}
    assert g["kgen.sub.b"] == {"kgen.sub.a"}
    assert cycles(g) == [["kgen.sub.a", "kgen.sub.b", "kgen.sub.a"]]


def test_kgen_imports_without_torch():
    """kgen, its runtime and its op registry import where torch is absent (kgen never
    imports it itself); kgen.torch then says what to install."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import kgen, kgen.runtime, kgen.ops, kgen.runtime.convention\n"
            "assert kgen.attention_dense_fast and kgen.ops.OPS\n"
            "try:\n    import kgen.torch\nexcept ImportError as e:\n    print(e)\n"
            "else:\n    raise SystemExit('kgen.torch imported without torch')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT.parent, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "kgen[torch]" in done.stdout, done.stdout
