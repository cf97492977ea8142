"""``kgen golden`` reproduces the committed golden/ byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest
from tc_helpers import REPO

from kgen.compiler.atomic import read_tree
from kgen.compiler.golden import FROZEN_FILE
from kgen.config import DEFAULTS

REFERENCE = (REPO / DEFAULTS["reference"]).resolve()


@pytest.mark.toolchain
@pytest.mark.skipif(not REFERENCE.is_file(),
                    reason=f"the hand-written reference is not here ({REFERENCE})")
def test_golden_is_reproducible(ws, monkeypatch, tmp_path):
    fresh = tmp_path / "golden-again"
    monkeypatch.setenv("KGEN_GOLDEN", str(fresh))
    r = ws.kgen("golden")
    assert r.rc == 0, r.text
    # frozen.json is `kgen freeze`'s, not the reference's: `kgen golden` keeps it.
    want = {n: b for n, b in read_tree(REPO / "golden").items() if n != FROZEN_FILE}
    got = read_tree(fresh)
    assert want, "the repo has no golden/"
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"golden/{name} differs when made again"
    # Made again over an existing golden: same bytes, no scratch trees left.
    r = ws.kgen("golden", "--reference", str(REFERENCE))
    assert r.rc == 0, r.text
    assert read_tree(fresh) == want
    assert [p.name for p in Path(tmp_path).iterdir() if p.name.startswith(".")] == []
