"""Benchmarks of mlxkv against mlx-lm (see benchmarks/run.py)."""

import mlxkv  # noqa: F401  (first: it picks the BLAS before mlx is imported)
