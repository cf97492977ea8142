"""Split a PTX module into its ``.entry`` blocks, normalised for comparison.

nvcc numbers basic-block labels by the function's index in the module
(``$L__BB<fn>_<block>``), so the same kernel compiled in another file carries
other label numbers. Within one entry the index is constant, so replacing it
is a bijection and keeps every difference that matters.
"""

from __future__ import annotations

import re

_ENTRY_START = re.compile(r"^(?:\.(?:visible|weak)\s+)?\.entry\s+(\w+)\s*\(", re.M)
_LABEL = re.compile(r"\$L__BB\d+_")


def entries(ptx_text: str) -> dict[str, str]:
    """Map kernel name -> its normalised ``.entry`` text (signature and body)."""
    out: dict[str, str] = {}
    for m in _ENTRY_START.finditer(ptx_text):
        start = m.start()
        # The body ends at the first closing brace alone on a line.
        end = ptx_text.find("\n}\n", start)
        end = len(ptx_text) if end < 0 else end + 3
        out[m.group(1)] = normalise(ptx_text[start:end])
    return out


def normalise(entry_text: str) -> str:
    return _LABEL.sub("$L__BB_", entry_text)


# -- one module's PTX as the PTX of each kernel compiled alone -----------------------------
# nvcc writes a module as: its header, then per kernel a ``// .globl`` line and the
# entry; the first kernel's line is followed by the module-level declarations of every
# kernel (``.extern .shared`` arrays, the ``has been demoted`` notes of their static
# shared arrays). A kernel compiled alone gets the same header, its own line, the
# declarations it uses (in module order), a blank line, its entry with the function
# index 0 in its labels and local depots, and one blank line after it. The build
# compiles the kernels of a module that miss the store as one translation unit (one
# front-end run instead of one per kernel) and stores each kernel's part under its
# own source's key; tests/toolchain/test_tc_units.py compiles kernels alone and checks
# the parts are exactly that.

_GLOBL = re.compile(r"^\t// \.globl\t(\w+)\n", re.M)
_DECL = re.compile(r"^(?:\.extern \.shared [^\n]*?(\w+)\[\];|// (\w+) has been demoted)\n",
                   re.M)
_DEPOT = re.compile(r"__local_depot\d+")


def split_module(ptx_text: str) -> dict[str, str]:
    """Map kernel name -> the PTX nvcc writes for that kernel compiled alone."""
    marks = list(_GLOBL.finditer(ptx_text))
    if not marks:
        return {}
    header = ptx_text[:marks[0].start()]
    decls = [(m.group(1), m.group(2), m.group(0)) for m in _DECL.finditer(ptx_text)]
    out = {}
    for i, m in enumerate(marks):
        name = m.group(1)
        end = marks[i + 1].start() if i + 1 < len(marks) else len(ptx_text)
        body = _DECL.sub("", ptx_text[m.end():end]).strip("\n")
        body = _DEPOT.sub("__local_depot0", _LABEL.sub("$L__BB0_", body))
        # A static of kernel ``name`` mangles as _ZZ<len><name>, then E (C parameters)
        # or the parameter types (a C++ class among them, e.g. __half) and E: the
        # length fixes the name, so the prefix is exact either way.
        mangled = f"_ZZ{len(name)}{name}"
        used = [d for array, demoted, d in decls
                if (array and re.search(rf"(?<![\w$]){array}(?![\w$])", body))
                or (demoted and demoted.startswith(mangled))]
        out[name] = header + m.group(0) + "".join(used) + "\n" + body + "\n\n"
    return out
