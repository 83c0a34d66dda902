"""The machine: its memory, its cores and the device MLX runs on.

Owns `memory_bytes` (the one reading every memory-based default starts from), `cpu_cores` and
`on_gpu`.
"""

from __future__ import annotations

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
