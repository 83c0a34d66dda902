"""Settings and their defaults, checked once, importable from every layer.

Owns: `parse_bytes` ("4GiB" -> bytes), `format_bytes` (bytes -> "4.0 GiB"), and
`CacheSettings` (the prompt cache's checked settings and the defaults `mlxkv serve` uses).
Imports nothing from mlxkv but `errors` and `platform`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from mlxkv.errors import check_int
from mlxkv.platform.machine import memory_bytes

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


def format_bytes(num_bytes: int) -> str:
    """Human-readable IEC size: 512 B, 40.2 MiB, 1.5 GiB."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/mlxkv/kv` (`~/.cache/mlxkv/kv` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlxkv" / "kv"


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
        budget = int(memory_bytes() * SERVER_MEMORY_FRACTION)
        return cls(SERVER_CACHE_ENTRIES, budget, default_cache_dir(), DEFAULT_DISK_BYTES)
