"""The process's limit of open files: raised for a server, and never lowered by mlx-lm.

mlx-lm sets it to (2048, 4096) as `mlx_lm.utils` is imported (ml-explore/mlx-lm#1589, open):
a hard limit above 4096 is capped for good (a process may never raise it again), and where the
hard limit is under 4096 (a container started with `--ulimit nofile=1024:1024`) the import
fails, and so did `import mlxkv`, with a traceback. `import_mlx_lm` imports it with that call
made gentle: it only raises the soft limit, within the hard one.

Owns `raise_open_files` (the one place the limit is changed) and `import_mlx_lm`.
"""

from __future__ import annotations

import importlib
import resource
import sys

# The soft limit a server asks for where it starts lower: macOS starts a process at 256 (a
# Terminal's `ulimit -n`), and refuses more than 10,240 (its OPEN_MAX) even under an
# unlimited hard limit.
OPEN_FILES_WANTED = 10_240
_SETRLIMIT = resource.setrlimit  # the real one, while `import_mlx_lm` replaces it


def raise_open_files(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raises this process's soft limit of open files to `wanted`, or to its hard limit if
    that is lower (Go's runtime does as much for every Go server, Ollama's included); never
    lowers either limit. Returns the soft limit now (unchanged where the system refuses)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # macOS refuses more than its OPEN_MAX: then that, never more than `wanted`
    for asked in dict.fromkeys((wanted, min(wanted, OPEN_FILES_WANTED))):
        target = asked if hard == resource.RLIM_INFINITY else min(asked, hard)
        if soft == resource.RLIM_INFINITY or soft >= target:
            return soft
        try:
            _SETRLIMIT(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            continue
        return target
    return soft


def import_mlx_lm() -> None:
    """Imports mlx-lm (its `utils`, which importing any part of it imports) with its setting
    of the open-file limit made `raise_open_files`; nothing where it is imported already."""
    if "mlx_lm.utils" in sys.modules:
        return

    def raise_only(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            _SETRLIMIT(which, limits)
        else:
            raise_open_files(limits[0])

    # for the whole process while mlx-lm is imported (once, as mlxkv is): another thread's
    # call meanwhile would be made gentle too
    resource.setrlimit = raise_only
    try:
        importlib.import_module("mlx_lm.utils")
    finally:
        resource.setrlimit = _SETRLIMIT
