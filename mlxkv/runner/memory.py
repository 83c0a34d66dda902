"""Memory reports: what the cache and the process hold, in bytes, and how to show them.

Owns: `MemoryReport` (bytes as ints) and `format_bytes` (IEC units: KiB, MiB, GiB).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxkv.cache.model_cache import ModelCache


@dataclass(frozen=True)
class MemoryReport:
    """A snapshot of cache and device memory. Every `*_bytes` field is in bytes.

    Attributes:
        num_tokens: tokens whose K/V (or recurrent state) the cache holds.
        used_bytes: bytes holding those tokens (sum over layers).
        allocated_bytes: bytes the cache has allocated, unused slots included.
        peak_bytes: MLX's peak memory since the last reset (per generation in the runner).
        active_bytes: memory MLX arrays hold right now.
        mlx_cache_bytes: memory MLX keeps for reuse (freed arrays not yet returned).
        checkpoint_bytes: snapshots of recurrent / sliding-window layers kept for rewinding.
    """

    num_tokens: int
    used_bytes: int
    allocated_bytes: int
    peak_bytes: int
    active_bytes: int
    mlx_cache_bytes: int
    checkpoint_bytes: int = 0

    @classmethod
    def measure(cls, cache: ModelCache) -> MemoryReport:
        return cls(
            num_tokens=cache.num_tokens,
            used_bytes=cache.used_bytes,
            allocated_bytes=cache.nbytes,
            peak_bytes=mx.get_peak_memory(),
            active_bytes=mx.get_active_memory(),
            mlx_cache_bytes=mx.get_cache_memory(),
            checkpoint_bytes=cache.checkpoint_bytes,
        )

    def log_line(self) -> str:
        """The one line logged after each generation."""
        line = (
            f"kv cache: {self.num_tokens} tokens, {format_bytes(self.used_bytes)} in use, "
            f"{format_bytes(self.allocated_bytes)} allocated, peak {format_bytes(self.peak_bytes)}"
        )
        if self.checkpoint_bytes:
            line += f", checkpoints {format_bytes(self.checkpoint_bytes)}"
        return line


def format_bytes(num_bytes: int) -> str:
    """Human-readable IEC size: 512 B, 40.2 MiB, 1.5 GiB."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
