"""`mlxkv serve` stopped as operators stop it: Ctrl-C (SIGINT) and `kill`, systemd or
`docker stop` (SIGTERM) both write the cache to the disk tier, within a bounded time, and
end with the usual status (130; killed by SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.factories import tiny_model_dir
from tests.processes import ready_url

ROOT = Path(__file__).resolve().parents[2]
_TIMEOUT_S = 120


@pytest.mark.parametrize(
    ("sig", "status"),
    [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_stop_signal_saves_the_cache_and_exits_as_usual(model_root, tmp_path, sig, status):
    model = str(tiny_model_dir("llama", model_root))
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxkv.cli", "serve", "-m", model, "--port", "0",
         "--cache-dir", str(tmp_path), "--no-warmup"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    try:
        url = ready_url(process, _TIMEOUT_S)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(
            model="m", max_tokens=3, messages=[{"role": "user", "content": "Hello"}]
        )
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == status, stderr
    assert "Traceback" not in stderr
    assert list(tmp_path.glob("*/*.safetensors")), stderr
