"""The Python side of the generated kernels, without a GPU: launch geometry,
the host split plan, the q4 prefill chunk bound, and that the generated
launchers, C header and manifest agree with the specs they came from."""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kgen import __version__
from kgen import numpy_ref as ref
from kgen.compiler import pipeline
from kgen.formats import FORMATS, as_pair
from kgen.ir.axes import Mode, Op, Position
from kgen.ir.geometry import flash_shared_bytes, min_head_dim
from kgen.ops import py_args
from kgen.runtime import ContractError, bind, decode_plan
from kgen.runtime.bind import shape_refusal
from kgen.runtime.record import axes_of
from kgen.testing import Case, host_args
from kgen.testing.built import BUILT, GENERATED, needs_build
from kgen.toolchain import fatbin

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def spec_kernels():
    return {k.name: k for k in pipeline.checked(pipeline.parse([ROOT / "specs"]))}


@pytest.fixture(scope="module")
def kgen_kernels():
    return pytest.importorskip("kgen_kernels", reason="no built kernels: run kgen build specs/")


@pytest.fixture(scope="module")
def launched(kgen_kernels):
    return {n: k for m in kgen_kernels.MODULES.values() for n, k in m.KERNELS.items()}


def test_every_spec_kernel_has_a_launcher_with_the_same_axes(spec_kernels, launched,
                                                            kgen_kernels):
    import inspect

    assert sorted(spec_kernels) == sorted(launched)
    for name, k in spec_kernels.items():
        assert axes_of(launched[name]) == axes_of(k), name
        fn = getattr(kgen_kernels, name)
        arrays, scalars = py_args(k)
        params = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
        assert params == [a.name for a in arrays], name
        sig = inspect.signature(fn).parameters
        assert [(p, sig[p].default) for p in sig if sig[p].kind is sig[p].KEYWORD_ONLY] == [
            (s.name, eval(s.default) if s.default is not None else inspect.Parameter.empty)
            for s in scalars] + [("stream", None)], name
        assert fn.kernel is launched[name] and fn.fatbin == BUILT.fatbin(name), name


def test_a_cache_array_has_its_formats_dtype(spec_kernels, monkeypatch):
    """The launcher asks each role's format for its rows' dtype (K rows kv's, V rows
    v_kv's: the same format but in a mixed kernel): a format of any element type (here
    ``unsigned short`` rows) gets its arrays checked as such."""
    for k in spec_kernels.values():
        arrays = {a.name: a.dtype for a in py_args(k)[0]}
        if "k_cache" in arrays:
            assert (arrays["k_cache"], arrays["v_cache"]) == (k.fmt.dtype, k.v_fmt.dtype), \
                k.name
    k = spec_kernels["attn_f16_decode_host"]
    monkeypatch.setitem(FORMATS, "f16", dataclasses.replace(FORMATS["f16"],
                                                            ctype="unsigned short",
                                                            dtype="uint16"))
    arrays = {a.name: a.dtype for a in py_args(dataclasses.replace(k))[0]}
    assert (arrays["k_cache"], arrays["v_cache"], arrays["q"]) == ("uint16", "uint16",
                                                                   "float32")


@pytest.mark.parametrize("name, groups, head_dim, expected", [
    # the reference host code's formulas at its shipped shape
    ("fc_attn_flash_prefill", 8, 256, 26720),
    ("fc_attn_flash_decode", 8, 256, 26720),
    ("fc_attn_flash_prefill_q4_kr", 8, 256, 9312),
    ("fc_attn_flash_prefill_q4_kvs", 8, 256, 11616),
    ("fc_attn_flash_prefill_q4_kh", 8, 256, 18016),
    ("fc_attn_flash_prefill_q4_kqh", 8, 256, 13920),
    ("fc_attn_flash_prefill", 1, 512, 4 * (512 + 16 * 528 + 2 * 16 + 3)),
    # query_tile: q tile, K-then-V tile (rows of head_dim + 1 floats) and P, any groups
    ("qt_f32_causal", 8, 128, 4 * (64 * 129 + 16 * 129 + 64 * 17)),
    ("qt_f32_causal", 1, 128, 4 * (64 * 129 + 16 * 129 + 64 * 17)),
    ("qt_q8_0_full_d256", 4, 256, 4 * (32 * 257 + 8 * 257 + 32 * 9)),
])
def test_shared_memory_formula(spec_kernels, name, groups, head_dim, expected):
    assert flash_shared_bytes(spec_kernels[name], groups, head_dim) == expected


def test_launch_geometry_follows_the_kernel_family(launched):
    k = launched["fc_attn_flash_prefill_q4_kvs"]
    case = Case("c", n=37, n_head=16, n_head_kv=2, max_seq=64, pos0=3, sink=4, win=16)
    b = bind(k, host_args(k, case))
    assert (b.grid, b.block, b.shared_bytes) == ((37, 2, 1), (256, 1, 1), 11616)
    assert b.arg("kv_groups") == 8 and b.arg("max_seq") == 64 and b.arg("pos0") == 3
    assert b.arg("scale") == np.float32(1 / 16)

    k = launched["fc_attn_flash_decode_slots"]
    case = Case("s", n_head=4, n_head_kv=2, max_seq=704, positions=(0, 130, 300), kps=64, cap=8)
    b = bind(k, host_args(k, case))
    assert b.grid == (8, 2, 3)  # launch width defaults to splits_cap
    args = {**host_args(k, case), "launch_splits": 5}  # the longest plan: 301 keys -> 5 splits
    assert bind(k, args).grid == (5, 2, 3)
    with pytest.raises(ContractError, match="slot plan coverage"):
        bind(k, {**args, "launch_splits": 4})

    # query_tile: a block per 64 (query, q head) rows of a kv head, 128 threads whatever
    # head_dim; the batch's row count is an argument, head_dim is bounded by the tile.
    k = launched["qt_f32_causal"]
    case = Case("t", n=37, n_head=16, n_head_kv=2, head_dim=96, max_seq=64, pos0=3)
    b = bind(k, host_args(k, case))
    assert (b.grid, b.block, b.shared_bytes) == ((math.ceil(37 * 8 / 64), 2, 1), (128, 1, 1),
                                                 4 * (64 * 97 + 16 * 97 + 64 * 17))
    assert b.arg("n_rows") == 37 and b.arg("kv_groups") == 8
    assert shape_refusal(k, 128, 8) is None and shape_refusal(k, 1, 1) is None
    assert "head_dim range" in shape_refusal(k, 160, 1)
    assert shape_refusal(k, 64, k.max_groups) is None  # rows pack the groups: no 8 bound
    assert "kv_groups" in shape_refusal(k, 64, k.max_groups + 1)
    assert "head_dim range" in shape_refusal(launched["qt_f32_causal_d256"], 288, 1)
    assert "row format" in shape_refusal(launched["qt_q8_0_causal_d256"], 80, 1)

    k = launched["fc_attn_qz_split"]
    b = bind(k, host_args(k, Case("q", n=7, n_head=3, head_dim=40)))
    assert b.grid == (math.ceil(7 * 3 * 40 / 256), 1, 1) and b.arg("total") == 840


def test_host_plan_is_the_device_formula():
    for seq_len in range(1, 1200, 7):
        for kps, cap in ((1, 1), (16, 4), (64, 8), (100, 3), (256, 16)):
            p = decode_plan(seq_len, kps, cap)
            assert (p.n_splits, p.split_len) == ref.decode_plan(seq_len, kps, cap)
            assert p.split_len % 16 == 0 and p.n_splits <= cap
            assert (p.n_splits - 1) * p.split_len < seq_len <= p.n_splits * p.split_len


@pytest.mark.parametrize("ring,win", [(256, 1), (256, 17), (256, 100), (256, 255), (256, 256),
                                      (64, 1), (64, 40), (64, 64)])
def test_prefill_chunk_is_the_largest_batch_the_ring_keeps_exact(ring, win):
    """KVCache.max_prefill_chunk: the longest batch in which no query's window key
    falls below the ring's live floor (so no row falls back to the body)."""
    from kgen.runtime.kv import KVCache

    chunk = KVCache.max_prefill_chunk(type("C", (), {"pair": as_pair("q4"), "win": win,
                                                     "RING_ROWS": ring,
                                                     "max_seq": 10**6})())

    def lapped(n: int, pos0: int = 500) -> bool:
        floor = ref.prefill_live_floor(pos0, n, ring)
        return any(cur - win + 1 <= floor for cur in range(pos0, pos0 + n))

    assert not lapped(chunk) and lapped(chunk + 1)


@needs_build
def test_c_header_embeds_each_kernels_fatbin(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    from kgen.config import Settings

    embed = Settings.load(ROOT).c_header_modules
    names = [e.name for e in BUILT.kernels.values() if embed is None or e.module in embed]
    assert names, "the header embeds no kernel"
    assert BUILT.c_header_modules == tuple(sorted({BUILT.kernels[n].module for n in names}))
    prog = tmp_path / "dump.c"
    prog.write_text(
        '#include <stdio.h>\n#include <stdint.h>\n#include <string.h>\n'
        f'#include "{BUILT.c_header}"\n'
        "int main(int argc, char **argv) {\n"
        + "".join(f'  if (!strcmp(argv[1], "{n}")) {{\n'
                  f"    if ((uintptr_t)KGEN_FATBIN_{n.upper()} % 8) return 2;\n"
                  f"    fwrite(KGEN_FATBIN_{n.upper()}, 1, KGEN_FATBIN_{n.upper()}_SIZE, "
                  "stdout);\n  }\n"
                  for n in names)
        + "  return 0;\n}\n")
    exe = tmp_path / "dump"
    subprocess.run([cc, "-std=c99", "-Wall", "-Werror", f"-I{GENERATED}", str(prog), "-o",
                    str(exe)], check=True)
    for n in names:
        out = subprocess.run([str(exe), n], capture_output=True, check=True).stdout
        assert out == BUILT.fatbin(n).read_bytes(), n


@needs_build
def test_generated_files_say_they_are_generated_and_from_what():
    from kgen.toolchain.cache import sha256

    for name, e in BUILT.kernels.items():
        src = (GENERATED / e.source).read_text()
        assert "GENERATED by kgen" in src[:400] and "do not edit" in src[:400], e.source
        assert f"specs:     {e.spec}" in src[:600] and f"module:    {e.module}" in src[:600]
        assert sha256(src.encode()) == e.source_sha256, name
        blob = BUILT.fatbin(name).read_bytes()
        assert sha256(blob) == e.fatbin_sha256, name
        for image in fatbin.entries(blob):
            assert image.ident == f"GENERATED by kgen {__version__} from {Path(e.source).name}" \
                                  " -- do not edit", (e.fatbin, image)


def _spec_kernel(text: str):
    from kgen.compiler.spec.parser import parse_spec

    return pipeline.checked([parse_spec(text, "t.kspec")])[0]


def test_contracts_no_shipped_kernel_reaches_yet():
    """Contracts whose violation needs an axis combination the shipped specs do not
    use: a shared K tile with the shared-V tile, and a lower append staging bound."""
    shared_kv = _spec_kernel("""kernel v : b { mode = prefill kv = q4 v_stage = shared_q4 }
        abstract kernel b { module = m op = flash }""")
    case = Case("c", n=4, n_head=2, n_head_kv=2, head_dim=256, max_seq=32)
    bind(shared_kv, host_args(shared_kv, case))
    with pytest.raises(ContractError, match=r"shared-V shape"):
        bind(shared_kv, host_args(shared_kv, case.with_(head_dim=512, n_head=1, n_head_kv=1)))

    small = _spec_kernel("kernel a { module = m op = kv_append kv = q4 max_head_dim = 256 }")
    case = Case("c", n=2, n_head_kv=1, head_dim=256, max_seq=8)
    bind(small, host_args(small, case))
    with pytest.raises(ContractError, match=r"static staging"):
        bind(small, host_args(small, case.with_(head_dim=512)))


def test_kernel_choice_follows_the_axes(spec_kernels):
    """The cache objects name no kernel: each role is served by a generated kernel
    whose axes match, at the shapes asked for; none serving is a clear error."""
    from kgen.runtime.kv import ROLES
    from kgen.runtime.select import Role, find

    for kv, fmt in FORMATS.items():
        for role_name, base in ROLES.items():
            role = Role(base.op, base.position, base.mode,
                        kv if base.op in (Op.FLASH, Op.KV_APPEND) else None)
            have = [k for k in spec_kernels.values() if role.matches(k)]
            if not have:
                continue
            hd = max(min_head_dim(k) if k.op is Op.FLASH else fmt.block for k in have)
            k, _ = find(role, hd)
            assert role.matches(k) and k.name in {h.name for h in have}, (kv, role_name)
    with pytest.raises(ContractError, match="no generated kernel serves"):  # past every block
        find(Role(Op.FLASH, Position.HOST, Mode.PREFILL, "f32"), head_dim=2048)
    with pytest.raises(ContractError, match="cannot serve"):
        find(Role(Op.FLASH, Position.HOST, Mode.PREFILL, "f32"), 256,
             variant=next(k.name for k in spec_kernels.values() if k.op is Op.KV_APPEND))


def test_the_default_prefill_is_a_query_tile_and_the_paged_one_its_sibling(spec_kernels):
    """Where a query_tile kernel (scalar loads) serves a prefill, it is the default
    choice, the 64-row tile where it reaches the head size; the paged prefill picks the
    same arithmetic (its sibling: the axes but the position), so one sequence prefills
    bit for bit alike; a batch of fewer rows than MIN_QUERY_TILES tiles takes the
    block_tile form, contiguous and paged alike (with MIN_QUERY_TILES = 0, even one row
    takes the query tile). Where none serves (kv with fp16 shadows, wider heads) the
    tiled form is chosen, paged and contiguous alike."""
    from kgen.formats import FORMATS
    from kgen.ir.geometry import qtile_vec4, query_tiles
    from kgen.runtime.bind import shape_refusal
    from kgen.runtime.record import forms_key
    from kgen.runtime.select import MIN_QUERY_TILES, Role, find

    pool = [(k, None) for k in spec_kernels.values()]
    qt = [k for k in spec_kernels.values() if k.op is Op.FLASH and query_tiles(k)
          and not qtile_vec4(k) and k.position is Position.HOST and k.mask.value == "causal"
          and k.window.value == "sink_recent"]
    assert qt, "the specs define a query-tile prefill"
    for kv in sorted(FORMATS):
        for hd in (64, 128, 256, 512):
            for groups in (1, 4, 8):
                if not FORMATS[kv].accepts_head_dim(hd):
                    continue
                serving = [k for k in qt if k.kv.value == kv
                           and shape_refusal(k, hd, groups) is None]
                dense, _ = find(Role(Op.FLASH, Position.HOST, Mode.PREFILL, kv), hd, groups,
                                kernels=pool)
                if serving:
                    tight = min(k.max_head_dim for k in serving)
                    assert query_tiles(dense) and dense.max_head_dim == tight, \
                        (kv, hd, groups, dense.name)
                else:
                    assert not query_tiles(dense), (kv, hd, groups, dense.name)
                if FORMATS[kv].shadows:
                    continue
                paged, _ = find(Role(Op.FLASH, Position.PAGED, Mode.PREFILL, kv), hd, groups,
                                kernels=pool)
                if query_tiles(dense):
                    assert forms_key(paged) == forms_key(dense), (kv, hd, groups, paged.name)
                    # Fewer rows than MIN_QUERY_TILES tiles: the block_tile form, alike.
                    few = -(-MIN_QUERY_TILES * dense.tile_rows // groups) - 1
                    for pos in (Position.HOST, Position.PAGED):
                        role = Role(Op.FLASH, pos, Mode.PREFILL, kv)
                        enough, _ = find(role, hd, groups, kernels=pool, rows=max(few + 1, 1))
                        assert query_tiles(enough), (kv, hd, groups, pos, enough.name)
                        if few >= 1:
                            small, _ = find(role, hd, groups, kernels=pool, rows=few)
                            assert not query_tiles(small), (kv, hd, groups, pos, small.name)
    with pytest.raises(ContractError, match="head_dim range"):
        find(Role(Op.FLASH, Position.HOST, Mode.PREFILL, "f32"), 256, 8,
             variant="qt_f32_causal", kernels=pool)


def test_decode_variants_pair_a_host_decode_with_its_device_sibling():
    from kgen.ir.geometry import streams
    from kgen.runtime.select import decode_variants, generated

    by_name = {k.name: k for k, _ in generated()}
    for kv in ("f32", "q4"):
        v = decode_variants(kv, 256, 2, streams)
        assert v is not None, kv
        host, dev = by_name[v["decode"]], by_name[v["decode_dev"]]
        assert streams(host) and host.position.value == "host" and host.kv.value == kv
        assert dev.position.value == "device" and dev.keys_per_step == host.keys_per_step
    assert decode_variants("f32", 256, 64, streams) is None  # more groups than any serves
