"""The machine: its memory, its cores and the device MLX runs on.

Owns `memory_bytes` (the one reading every memory-based default starts from), `cpu_cores`,
`on_gpu` and `return_freed_memory`.
"""

from __future__ import annotations

import ctypes
import functools
import os

import mlx.core as mx


def memory_bytes() -> int:
    """Memory the device can use: what MLX reports for it (a Mac's unified memory, a GPU's),
    else the operating system's physical memory, else 8 GiB when neither says."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    size = info.get("memory_size") if isinstance(info, dict) else None
    if size:
        return int(size)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def on_gpu() -> bool:
    """True when MLX's default device is a GPU (Metal on a Mac, CUDA elsewhere)."""
    return mx.default_device() != mx.cpu


def return_freed_memory() -> bool:
    """Hands the C heap's free pages back to the system, where the C library keeps them
    (glibc's `malloc_trim`: the arenas its threads used hold what they freed, and a server
    that unloaded a model kept its resident size, 1.4 GB more than needed after a load of
    several models at once, fuzz22). False where there is no such call (macOS)."""
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))


@functools.cache
def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # no such call; Windows has no CDLL(None)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim
