"""What this machine is and the process-wide state MLX keeps: the BLAS behind MLX's CPU
backend, memory and cores, threads' streams, and the random key.

Imports nothing from the rest of mlxkv but `config` and `errors` (which import no mlx). This
package's `__init__` imports nothing at all: `import mlxkv` must choose the BLAS
(`blas.select_blas`) before mlx is first imported.
"""
