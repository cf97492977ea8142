"""The compile unit is one kernel. The build compiles the kernels of a module that miss
the store in one nvcc run and stores each kernel's part of that PTX under its own
source's key, which is only sound when the part is exactly what the kernel compiles to
alone: checked here for two kernels of every module, compiled both ways afresh."""

from __future__ import annotations

import pytest
from tc_helpers import REPO

from kgen.compiler import pipeline
from kgen.compiler.render import render_batch
from kgen.config import Settings
from kgen.toolchain import compile, ptx_entries
from kgen.toolchain.cache import Cache
from kgen.toolchain.locate import find_toolchain

pytestmark = pytest.mark.toolchain


@pytest.fixture(scope="module")
def units(tmp_path_factory):
    settings = Settings.load(REPO)
    ctx = pipeline.Context(settings, Cache(tmp_path_factory.mktemp("nocache"), enabled=False),
                           locate_toolchain=find_toolchain)
    work = pipeline.run(("parse", "context", "check", "render"),
                        pipeline.Work(inputs=(settings.specs,)), ctx)
    by_module: dict[str, list] = {}
    for m in work.modules:
        by_module.setdefault(m.group, []).append(m)
    return by_module, ctx


def test_a_batch_splits_into_what_each_kernel_compiles_to_alone(units):
    by_module, ctx = units
    assert by_module
    for group, mods in by_module.items():
        picked = mods[:1] + mods[-1:] if len(mods) > 1 else mods
        kernels = [k for m in picked for k in m.kernels]
        s = ctx.settings
        batch = render_batch(group, kernels, s.templates, s.root, ctx.cache_dir)
        parts = ptx_entries.split_module(compile.ptx(batch.source, ctx.toolchain, ctx.cache))
        assert set(parts) == {m.name for m in picked}, group
        for m in picked:
            alone = compile.ptx(m.source, ctx.toolchain, ctx.cache, name=m.name)
            assert parts[m.name] == alone, f"{group}: {m.name} differs compiled in a batch"


def test_a_kernel_compiles_the_same_wherever_its_batch_put_it(units, tmp_path):
    """The build's ptx stage, through a store: a batch of misses and a unit alone
    store the same PTX under the same key."""
    by_module, ctx = units
    group, mods = max(by_module.items(), key=lambda kv: len(kv[1]))
    first, second = mods[0], mods[1]
    stores = []
    for i, picked in enumerate(([first], [first, second])):
        c = pipeline.Context(ctx.settings, Cache(tmp_path / f"store{i}"),
                             locate_toolchain=find_toolchain)
        work = pipeline.run(("ptx",), pipeline.Work(modules=tuple(picked)), c)
        assert work.compiled_units == tuple(m.name for m in picked)
        stores.append(compile.stored_ptx(first.source, c.toolchain, c.cache))
        again = pipeline.run(("ptx",), pipeline.Work(modules=tuple(picked)), c)
        assert again.compiled_units == ()  # all from the store now
    assert stores[0] is not None and stores[0] == stores[1]
