"""Identity is decided on a kernel's cubin .text section: it must be exactly the
encoded stream the disassembler lists (control words included)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tc_helpers import covering_specs, repo_context

from kgen.compiler import pipeline
from kgen.toolchain import elf, sass_listing

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.toolchain
def test_text_sections_are_the_listed_encodings(session_cache):
    # The spec files that reach every skeleton and format (covering_specs).
    ctx = repo_context(session_cache)
    work = pipeline.run(("parse", "context", "check", "render", "ptx", "cubin", "sass"),
                        pipeline.Work(inputs=tuple(Path(p) for p in covering_specs())), ctx)
    assert work.builds
    for b in work.builds:
        code = elf.kernel_code(b.cubin)
        listing = b.sass
        assert set(code) == set(listing) and code, b.module.name
        for name, stream in listing.items():
            assert code[name] == sass_listing.encode(stream), name
            assert len(code[name]) == 8 * len(stream)


def test_elf_reader_rejects_other_files():
    with pytest.raises(elf.ElfError):
        elf.sections(b"not an elf file at all, just some bytes")
