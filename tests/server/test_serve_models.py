"""`mlxkv serve` with several `-m`: each model by its name (`NAME=MODEL` or the directory's
name), `--alias` patterns, a 404 naming the served models for any other name, and every
model's cache saved on the way out."""

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


def test_two_models_by_name_and_alias_each_with_its_cache(model_root, tmp_path):
    llama, qwen = tiny_model_dir("llama", model_root), tiny_model_dir("qwen3", model_root)
    args = ["-m", str(llama), "-m", f"coder={qwen}", "--alias", "claude-*=coder"]
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxkv.cli", "serve", *args, "--port", "0",
         "--cache-dir", str(tmp_path), "--no-warmup"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    try:
        url = ready_url(process, _TIMEOUT_S)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert sorted(m.id for m in client.models.list()) == sorted([llama.name, "coder"])
        ask = [{"role": "user", "content": "Hello"}]
        for name in (llama.name, "coder", "claude-sonnet-5"):
            reply = client.chat.completions.create(model=name, max_tokens=3, messages=ask)
            want = "coder" if name.startswith("claude") else name
            assert reply.model == want
        with pytest.raises(openai.NotFoundError, match="coder"):
            client.chat.completions.create(model="gpt-x", max_tokens=3, messages=ask)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "Traceback" not in stderr
    assert len(list(tmp_path.glob("*/*.safetensors"))) >= 2, stderr  # each model's own tier
