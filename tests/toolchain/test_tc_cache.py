"""The artifact cache: hits skip the tools, damage is detected and repaired, the
key covers every input, and concurrent builders share one cache safely."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
from tc_helpers import TINY_CU, cache_temp_dirs, covering_specs, finish, kgen_process

from kgen.compiler.atomic import read_tree
from kgen.toolchain import compile
from kgen.toolchain.cache import Cache, sha256
from kgen.toolchain.compile import CompileJob
from kgen.toolchain.locate import Toolchain

toolchain = pytest.mark.toolchain


@pytest.fixture
def tool_calls(monkeypatch) -> list[str]:
    """The tools Toolchain.run starts, in order (they still run)."""
    calls: list[str] = []
    real = Toolchain.run

    def counting(self, argv, cwd=None):
        calls.append(Path(argv[0]).name)
        return real(self, argv, cwd)

    monkeypatch.setattr(Toolchain, "run", counting)
    return calls


def all_stages(tc, cache) -> tuple[str, bytes, str, str]:
    text = compile.ptx(TINY_CU, tc, cache, name="tiny")
    cub = compile.cubin(text, tc, cache, name="tiny")
    return text, cub.data, cub.ptxas_log, compile.sass(cub.data, tc, cache, name="tiny")


def entries(cache: Cache) -> list[Path]:
    return sorted(p.parent for p in cache.root.glob("*/*/manifest.json"))


def ptx_entry(cache: Cache, tc) -> Path:
    job = compile.ptx_job(TINY_CU, tc)
    d = cache.root / job.key[:2] / job.key
    assert (d / "manifest.json").is_file()
    return d


@toolchain
def test_a_second_compile_is_a_hit_and_runs_no_tool(tc, tmp_path, tool_calls, monkeypatch):
    cache = Cache(tmp_path / "cache")
    first = all_stages(tc, cache)
    assert tool_calls == ["nvcc", "ptxas", "cuobjdump"]
    assert len(entries(cache)) == 3

    def no_tools(self, argv, cwd=None):
        raise AssertionError(f"cache hit expected, but {argv[0]} ran")

    monkeypatch.setattr(Toolchain, "run", no_tools)
    assert all_stages(tc, cache) == first
    # Another cache object on the same directory (another process) hits too.
    assert all_stages(tc, Cache(cache.root)) == first


@toolchain
def test_a_disabled_cache_always_runs_the_tools(tc, tmp_path, tool_calls):
    cache = Cache(tmp_path / "cache", enabled=False)
    first = all_stages(tc, cache)
    assert all_stages(tc, cache) == first
    assert tool_calls == ["nvcc", "ptxas", "cuobjdump"] * 2
    assert not (tmp_path / "cache").exists()


def _flip_a_byte(d: Path) -> None:
    p = d / "out.ptx"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _manifest_json(value):
    def damage(d: Path) -> None:
        key = d.name
        v = value(key) if callable(value) else value
        (d / "manifest.json").write_text(v if isinstance(v, str) else json.dumps(v))
    return damage


DAMAGE = {
    "flipped byte": _flip_a_byte,
    "truncated artifact": lambda d: (d / "out.ptx").write_bytes((d / "out.ptx").read_bytes()[:10]),
    "artifact deleted": lambda d: (d / "out.ptx").unlink(),
    "manifest deleted": lambda d: (d / "manifest.json").unlink(),
    "manifest truncated": _manifest_json('{"key": "'),
    "manifest a list": _manifest_json([]),
    "manifest files a list": _manifest_json(lambda k: {"key": k, "files": ["out.ptx"]}),
    "manifest lists nothing": _manifest_json(lambda k: {"key": k, "files": {}}),
    "manifest of another key": _manifest_json(lambda k: {"key": "0" * 64, "files": {}}),
}


@toolchain
@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_entry_is_detected_and_rebuilt(tc, tmp_path, tool_calls, damage):
    cache = Cache(tmp_path / "cache")
    good = compile.ptx(TINY_CU, tc, cache, name="tiny")
    d = ptx_entry(cache, tc)
    damage(d)
    tool_calls.clear()
    assert compile.ptx(TINY_CU, tc, cache, name="tiny") == good
    assert tool_calls == ["nvcc"]
    # The entry is whole again, and nothing was left beside it.
    assert cache.get(d.name, ("out.ptx",)) == {"out.ptx": good.encode()}
    assert cache_temp_dirs(cache.root) == []
    tool_calls.clear()
    assert compile.ptx(TINY_CU, tc, cache, name="tiny") == good
    assert tool_calls == []


def test_the_key_covers_every_input():
    base = CompileJob("ptx", sha256(b"src"), ("-ptx", "-arch=sm_37"),
                      (("nvcc", "release 11.8, V11.8.89"),), "0.1.0")
    variants = {
        "same": dataclasses.replace(base),
        "stage": dataclasses.replace(base, stage="cubin"),
        "source": dataclasses.replace(base, input_sha256=sha256(b"src ")),
        "flags": dataclasses.replace(base, flags=("-ptx", "-arch=sm_35")),
        "flag order": dataclasses.replace(base, flags=("-arch=sm_37", "-ptx")),
        "extra flag": dataclasses.replace(base, flags=("-ptx", "-arch=sm_37", "-lineinfo")),
        "tool version": dataclasses.replace(base, tools=(("nvcc", "release 11.8, V11.8.90"),)),
        "another tool": dataclasses.replace(
            base, tools=(("nvcc", "release 11.8, V11.8.89"), ("ptxas", "release 11.8"))),
        "kgen version": dataclasses.replace(base, kgen_version="0.1.1"),
    }
    assert variants["same"].key == base.key
    keys = [v.key for n, v in variants.items() if n != "same"]
    assert base.key not in keys and len(set(keys)) == len(keys)
    assert all(len(k) == 64 for k in keys)


@toolchain
def test_other_tool_versions_miss_the_cache(tc, tmp_path, tool_calls):
    cache = Cache(tmp_path / "cache")
    good = compile.ptx(TINY_CU, tc, cache, name="tiny")
    other = dataclasses.replace(tc, versions=(*tc.versions[:-1], ("cuobjdump", "release 11.8 x")))
    tool_calls.clear()
    assert compile.ptx(TINY_CU, other, cache, name="tiny") == good
    assert tool_calls == ["nvcc"]
    tool_calls.clear()
    compile.ptx(TINY_CU + "\n", tc, cache, name="tiny")  # other source bytes
    assert tool_calls == ["nvcc"]
    assert len(entries(cache)) == 3


def test_concurrent_puts_of_one_key_leave_one_whole_entry(tmp_path):
    cache = Cache(tmp_path / "cache")
    key = sha256(b"k")
    files = {"out.bin": b"x" * 100_000, "log": b"done"}
    seen: list[dict | None] = []
    start = threading.Barrier(8)

    def writer():
        start.wait()
        for _ in range(20):
            cache.put(key, files)
            seen.append(cache.get(key, files))

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # A reader sees the whole entry or a miss, never a part of one.
    assert all(s is None or s == files for s in seen)
    assert cache.get(key, files) == files
    assert cache_temp_dirs(cache.root) == []


def test_put_replaces_a_damaged_entry_and_keeps_a_good_one(tmp_path):
    cache = Cache(tmp_path / "cache")
    key = sha256(b"k")
    d = tmp_path / "cache" / key[:2] / key
    d.mkdir(parents=True)
    (d / "junk").write_text("half-written")
    cache.put(key, {"a": b"1"})
    assert cache.get(key) == {"a": b"1"} and not (d / "junk").exists()
    cache.put(key, {"a": b"1"})
    assert cache.get(key) == {"a": b"1"}
    assert cache_temp_dirs(cache.root) == []


@toolchain
def test_two_builds_share_one_cache_at_once(tmp_path):
    cache_dir = tmp_path / "cache"
    procs = [kgen_process("build", "-q", *covering_specs(), scratch=tmp_path / f"out{i}",
                          cache_dir=cache_dir, generated=tmp_path / f"gen{i}")
             for i in (1, 2)]
    for r in finish(procs):
        assert r.rc == 0, r.text
    a, b = read_tree(tmp_path / "gen1"), read_tree(tmp_path / "gen2")
    assert a and a == b
    assert cache_temp_dirs(cache_dir) == []
    kernels = json.loads(a["manifest.json"])["kernels"]
    found = entries(Cache(cache_dir))
    assert len(found) == 3 * len(kernels)  # ptx, cubin, fatbin per kernel (sass for diffs)
    cache = Cache(cache_dir)
    for d in found:
        assert cache.get(d.name) is not None, f"damaged entry {d}"
