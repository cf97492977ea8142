"""``kgen build -o DIR``: the named specs' kernels in a tree of their own; the generated
tree the settings name is left as it was."""

from __future__ import annotations

import json

import pytest
from tc_helpers import REPO, finish, kgen_process

from kgen.compiler import pipeline
from kgen.compiler.atomic import read_tree

pytestmark = pytest.mark.toolchain


def test_build_into_another_directory(tmp_path):
    spec = REPO / "specs" / "merge.kspec"
    default = tmp_path / "generated"
    out = tmp_path / "elsewhere"
    (r,) = finish([kgen_process("build", "-q", "-o", str(out), str(spec), scratch=tmp_path,
                                generated=default)])
    assert r.rc == 0, r.text
    want = {k.name for k in pipeline.checked(pipeline.parse([REPO / "specs"], REPO))
            if k.spec_path == "specs/merge.kspec"}
    assert want and set(json.loads((out / "manifest.json").read_text())["kernels"]) == want
    assert not read_tree(default)  # the settings' own tree: not written
