"""OpenBLAS vs MLX's bundled reference BLAS on Linux: the same measurement in two processes,
since the BLAS is chosen when mlx is first imported (MLXKV_OPENBLAS=1 / 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_PROBE = """
import json, sys, time
from benchmarks.common import Stat, token_prompt
from mlxkv import Runner
from mlxkv.platform import blas as _blas
from mlxkv.models.loading import load_model
loaded = load_model(sys.argv[1] if len(sys.argv) > 1 else None)
runner = Runner(loaded)
ids = token_prompt(loaded, 128)
prefill, decode = [], []
for _ in range(3):
    runner.reset()
    start = time.perf_counter()
    times = [time.perf_counter() for c in runner.stream(ids, max_tokens=16) if c.token]
    prefill.append(128 / (times[0] - start))
    decode.append((len(times) - 1) / (times[-1] - times[0]))
print(json.dumps({"blas": _blas.blas_in_use, "prefill_tps": Stat.of(prefill).median,
                  "decode_tps": Stat.of(decode).median}))
"""


def measure(model: str | None = None) -> dict:
    """{"openblas": {...}, "reference": {...}, "prefill_speedup", "decode_speedup"}."""
    if not sys.platform.startswith("linux"):
        return {}
    results = {}
    for name, setting in (("openblas", "1"), ("reference", "0")):
        env = {**os.environ, "MLXKV_OPENBLAS": setting}
        args = [sys.executable, "-c", _PROBE] + ([model] if model else [])
        out = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("prefill_tps", "decode_tps"):
        speedup = results["openblas"][key] / results["reference"][key]
        results[key.replace("_tps", "_speedup")] = speedup
    return results
