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
