"""The prompt cache's settings: how many entries, byte budgets, the disk tier, and the model
fingerprint that keeps a disk tier's files to the model that wrote them.

Owns: `parse_bytes` ("4GiB" -> bytes), `CacheSettings` (checked settings and the defaults
`mlxkv serve` uses), `model_fingerprint`, and building the `CachePool`. Does not own the pool's
policy (`mlxkv.cache.pool`) or the file format (`mlxkv.cache.store`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxkv.cache.model_cache import ModelCache
from mlxkv.cache.pool import CachePool
from mlxkv.cache.serialize import layout_signature
from mlxkv.cache.store import DiskStore
from mlxkv.runner.checks import check_int
from mlxkv.runner.loading import LoadedModel

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})

DEFAULT_DISK_BYTES = 16 * 2**30
# `mlxkv serve`'s defaults: a few conversations and their side requests, a quarter of the
# machine's memory, and a disk tier that survives restarts.
SERVER_CACHE_ENTRIES = 8
SERVER_MEMORY_FRACTION = 0.25


def parse_bytes(value: int | str, name: str = "size") -> int:
    """Bytes from an int or a string such as "4GiB", "512MiB", "1.5GB", "800000".

    Raises:
        ValueError: not a size, or not positive.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of bytes such as 4GiB; got {value!r}")
    if isinstance(value, int):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name} must be a number of bytes such as 4GiB, 512MiB or 1000000; got {value!r}"
            )
        number = int(float(match.group(1)) * _UNITS[unit])
    if number <= 0:
        raise ValueError(f"{name} must be more than 0 bytes; got {value!r}")
    return number


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/mlxkv/kv` (`~/.cache/mlxkv/kv` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlxkv" / "kv"


def machine_memory_bytes() -> int:
    """Physical memory: what MLX reports for the device, else the operating system's."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    size = info.get("memory_size") if isinstance(info, dict) else None
    if size:
        return int(size)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class CacheSettings:
    """Checked prompt-cache settings.

    Attributes:
        entries: most entries held in memory (1: one entry, trimmed in place).
        max_bytes: the entries' byte budget; None for no limit.
        directory: the disk tier's directory; None for no disk tier.
        directory_bytes: the disk tier's byte budget.
    """

    entries: int = 1
    max_bytes: int | None = None
    directory: Path | None = None
    directory_bytes: int = DEFAULT_DISK_BYTES

    @classmethod
    def check(
        cls,
        entries: int,
        max_bytes: int | str | None,
        directory: str | Path | None,
        directory_bytes: int | str | None,
    ) -> CacheSettings:
        """Raises ValueError for settings of the wrong type or out of range."""
        check_int("cache_entries", entries, low=1)
        budget = None if max_bytes is None else parse_bytes(max_bytes, "cache_bytes")
        disk = (
            DEFAULT_DISK_BYTES
            if directory_bytes is None
            else parse_bytes(directory_bytes, "cache_dir_bytes")
        )
        path = None if directory is None else Path(directory).expanduser()
        if path is not None and path.exists() and not path.is_dir():
            raise ValueError(f"cache_dir {str(path)!r} exists and is not a directory")
        return cls(entries, budget, path, disk)

    @classmethod
    def for_server(cls) -> CacheSettings:
        """`mlxkv serve`'s defaults: 8 entries, a quarter of the machine's memory, and a disk
        tier of 16 GiB under the user cache directory."""
        budget = int(machine_memory_bytes() * SERVER_MEMORY_FRACTION)
        return cls(SERVER_CACHE_ENTRIES, budget, default_cache_dir(), DEFAULT_DISK_BYTES)


def model_fingerprint(loaded: LoadedModel) -> str:
    """A hash of the model's config and weights: every tensor's name, shape, dtype and a sample
    of its values (first, middle and last elements), so another checkpoint or fine-tune of the
    same architecture gets another fingerprint without reading every weight."""
    digest = hashlib.sha256(json.dumps(loaded.config, sort_keys=True, default=str).encode())
    for name, weight in tree_flatten(loaded.model.parameters()):
        flat = weight.reshape(-1)
        n = flat.size
        sample = mx.concatenate([flat[:8], flat[n // 2 : n // 2 + 8], flat[-8:]])
        values = np.asarray(sample.astype(mx.float32) if sample.dtype == mx.bfloat16 else sample)
        digest.update(f"{name}|{weight.shape}|{weight.dtype}|".encode() + values.tobytes())
    return digest.hexdigest()


def make_pool(
    loaded: LoadedModel, make_entry: Callable[[], ModelCache], settings: CacheSettings
) -> CachePool:
    """The pool for these settings, its disk tier indexed (a restart finds its files)."""
    store = None
    if settings.directory is not None:
        empty: ModelCache = make_entry()
        store = DiskStore(
            settings.directory,
            fingerprint=model_fingerprint(loaded),
            signature=layout_signature(empty),
            max_bytes=settings.directory_bytes,
            trimmable=not empty.needs_checkpoints,
        )
    return CachePool(
        make_entry, max_entries=settings.entries, max_bytes=settings.max_bytes, store=store
    )
