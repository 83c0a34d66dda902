"""Choosing the BLAS that MLX's CPU backend calls, on Linux. Runs at `import mlxkv`, before mlx.

The `mlx[cpu]` wheel links a reference BLAS; loading the system's OpenBLAS first with
RTLD_GLOBAL makes MLX's BLAS calls resolve to it (measured here: SmolLM2 float32 prefill about
20x faster). Set MLXKV_OPENBLAS=0 to keep the reference BLAS, or MLXKV_OPENBLAS=/path/to/lib to
name the library.

Also owns OpenBLAS's thread count while a block runs (`blas_threads`): the CPU prefill lanes
(`mlxkv.decoding.prefill.lanes`) give each lane one core. Logs which BLAS is in use at DEBUG and
warns once when only the slow one is available.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlxkv.config import env

logger = logging.getLogger(__name__)

# Debian/Ubuntu `libopenblas0-pthread` (or -openmp / -serial) and common other layouts.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-serial/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
INSTALL_HINT = "sudo apt-get install libopenblas0-pthread"

blas_in_use = "platform default"
_openblas: ctypes.CDLL | None = None  # the library loaded, for its thread count


def select_blas() -> str:
    """Loads OpenBLAS for MLX on Linux if it is installed and allowed; returns what is used."""
    global blas_in_use, _openblas
    if not sys.platform.startswith("linux"):
        return blas_in_use
    setting = env("MLXKV_OPENBLAS") or "1"
    if setting.lower() in ("0", "false", "no", "off"):
        blas_in_use = "reference (MLXKV_OPENBLAS=0)"
    elif "mlx.core" in sys.modules:
        blas_in_use = "reference (mlx was imported before mlxkv)"
        logger.debug("blas: mlx.core already imported; import mlxkv first to use OpenBLAS")
    else:
        path, library = _load(setting)
        if path is not None:  # MLXKV_OPENBLAS may name another BLAS (MKL, BLIS, reference)
            _openblas = library if hasattr(library, "openblas_get_config") else None
            blas_in_use = f"{'OpenBLAS' if _openblas else 'BLAS'} ({path})"
        else:
            blas_in_use = "reference"
            warnings.warn(
                "mlxkv: OpenBLAS not found, so MLX's CPU backend uses its slow reference BLAS "
                f"(about 20x slower prefill). Install it: {INSTALL_HINT}",
                RuntimeWarning,
                stacklevel=3,
            )
    logger.debug("blas: %s", blas_in_use)
    return blas_in_use


def _load(setting: str) -> tuple[Path | None, ctypes.CDLL | None]:
    """Loads the named library, else the first installed candidate; returns its path and
    handle, or Nones. A setting that names no loadable library is warned about, never fatal to
    `import mlxkv`."""
    named = [] if setting.lower() in ("1", "true", "yes", "on") else [Path(setting)]
    for path in [*named, *(Path(p) for p in _CANDIDATES)]:
        if not path.exists():
            if path in named:
                warnings.warn(
                    f"mlxkv: MLXKV_OPENBLAS={setting} does not exist; trying the usual places",
                    RuntimeWarning,
                    stacklevel=4,
                )
            continue
        try:
            library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            problem = f"could not load {path} as a BLAS library ({error})"
        else:
            if hasattr(library, "sgemm_"):
                return path, library
            problem = f"{path} is not a BLAS library (it has no sgemm_)"
        warnings.warn(
            f"mlxkv: {problem}; trying the usual places. Set MLXKV_OPENBLAS to a libblas.so, "
            "1 (find it) or 0 (MLX's own)",
            RuntimeWarning,
            stacklevel=4,
        )
    return None, None


@contextmanager
def blas_threads(count: int) -> Iterator[None]:
    """OpenBLAS uses `count` threads per call inside the block and its own count again after
    (process-wide; a no-op where OpenBLAS is not the BLAS in use or has no thread control)."""
    control = _openblas is not None and hasattr(_openblas, "openblas_set_num_threads")
    before = _openblas.openblas_get_num_threads() if control else 0
    if control and before != count:
        _openblas.openblas_set_num_threads(count)
    try:
        yield
    finally:
        if control and before != count:
            _openblas.openblas_set_num_threads(before)
