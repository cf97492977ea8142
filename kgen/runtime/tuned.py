"""The tune store: the decode plan and variant, and the prefill variant, that
`kgen tune` (kgen.tune.search) chose per shape class on a GPU, and the lookups the
cache objects make when no plan or variant is given.

A shape class is (KV format, head_dim, kv_groups, context bucket) for decode and
(KV format, head_dim, kv_groups, batch rows bucket) for prefill. The store is a
JSON file per device name and driver version; each entry carries the source hash
of its kernel's module, and an entry whose kernel source changed since is stale
and ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Choice:
    kernel: str
    source_sha256: str
    kps: int
    splits_cap: int
    us: float


def bucket(seq_len: int) -> int:
    """The context bucket a length falls in: the next power of two (at least 1024)."""
    return max(1024, 1 << max(seq_len - 1, 1).bit_length())


def shape_key(kv: str, head_dim: int, groups: int, seq_len: int) -> str:
    return f"decode/{kv}/hd{head_dim}/g{groups}/ctx{bucket(seq_len)}"


def rows_bucket(rows: int) -> int:
    """The prefill batch bucket a row count falls in: the next power of two (at least 128)."""
    return max(128, 1 << max(rows - 1, 1).bit_length())


def prefill_key(kv: str, head_dim: int, groups: int, rows: int) -> str:
    return f"prefill/{kv}/hd{head_dim}/g{groups}/rows{rows_bucket(rows)}"


def cache_path(device: str, driver: int) -> Path:
    from kgen.config import Settings

    root = Path(os.environ.get("KGEN_TUNE_DIR") or Path(Settings.load().cache_dir) / "tune")
    safe = "".join(c if c.isalnum() else "_" for c in device)
    return root / f"{safe}-driver{driver}.json"


def current_device() -> tuple[str, int]:
    """The current device's name and the driver's version (asked once per device:
    neither changes while a process runs, and the properties query is slow)."""
    import cupy as cp

    index = cp.cuda.runtime.getDevice()
    d = _devices.get(index)
    if d is None:
        props = cp.cuda.runtime.getDeviceProperties(index)
        d = _devices[index] = (props["name"].decode(), cp.cuda.runtime.driverGetVersion())
    return d


_devices: dict[int, tuple[str, int]] = {}


def module_sha(kernel: str) -> str:
    """The hash of the source ``kernel`` was compiled from (its manifest entry): a
    stored choice names the kernel as it was built."""
    import kgen_kernels

    e = kgen_kernels.MANIFEST.kernels.get(kernel)
    return e.source_sha256 if e is not None else ""


def load(device: str, driver: int) -> dict[str, Choice]:
    try:
        raw = json.loads(cache_path(device, driver).read_text())
    except (OSError, ValueError):
        return {}
    return {k: Choice(**v) for k, v in raw.get("choices", {}).items()}


def tuned(kv: str, head_dim: int, groups: int, seq_len: int) -> Choice | None:
    """The stored choice for this shape class on this GPU and driver, unless stale.
    KVCache.decode asks on every step without a plan: the store is read (and its
    stale entries dropped) once, until ``kgen tune`` saves or ``_loaded`` is
    cleared."""
    table = _table()
    if table is None:
        return None
    shape = (kv, head_dim, groups, bucket(seq_len))  # shape_key's parts, looked up once
    c = table.get(shape, _UNSEEN)
    if c is _UNSEEN:
        c = table[shape] = table.get(shape_key(kv, head_dim, groups, seq_len))
    return c


def tuned_prefill(kv: str, head_dim: int, groups: int, rows: int) -> Choice | None:
    """The stored prefill choice for this class on this GPU and driver, unless stale
    (kps and splits_cap are 0: a prefill has no plan)."""
    table = _table()
    return None if table is None else table.get(prefill_key(kv, head_dim, groups, rows))


def _table() -> dict | None:
    """This GPU and driver's current entries (stale ones dropped), read once; None
    without CuPy or a GPU (nothing tuned applies)."""
    try:
        key = current_device()
    except Exception:
        return None
    table = _loaded.get(key)
    if table is None:
        table = _loaded[key] = {k: c for k, c in load(*key).items()
                                if c.source_sha256 == module_sha(c.kernel)}
    return table


_UNSEEN = object()
# Per device and driver: the current entries by shape_key, and the lookups made by
# (kv, head_dim, groups, bucket).
_loaded: dict[tuple[str, int], dict] = {}


def save(device: str, driver: int, choices: dict[str, Choice]) -> Path:
    """Replace this device and driver's store with ``choices`` (atomically); the
    next lookup reads it."""
    import tempfile

    path = cache_path(device, driver)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"device": device, "driver": driver,
            "choices": {k: asdict(v) for k, v in sorted(choices.items())}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tune-")
    with os.fdopen(fd, "w") as f:  # a reader sees the old file or the new one
        f.write(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    _loaded.pop((device, driver), None)
    return path
