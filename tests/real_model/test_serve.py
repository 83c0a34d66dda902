"""`mlxkv serve` as a user starts it (a subprocess, the default model, port 0), asked through the
real OpenAI and Anthropic clients."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest

from tests.processes import ready_url

ROOT = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
_READY_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def server_url(converted_cache):
    """The server on its defaults; $MLXKV_CACHE_DIR (`converted_cache`) holds the conversion
    and the default disk tier (kv/)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxkv.cli", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, MLXKV_CACHE_DIR=str(converted_cache)),
    )
    try:
        yield ready_url(process, _READY_TIMEOUT_S)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        assert process.returncode == 130, stderr  # the shell's code for Ctrl-C
        assert "Traceback" not in stderr
        assert re.search(r"POST /v1/messages 200 .* cached=\d+ .*kv cache:", stderr), stderr
        # on the way out the server wrote its entries to the default disk tier
        assert list((converted_cache / "kv").glob("*/*.safetensors")), stderr


def test_openai_client_gets_paris(server_url):
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model="gpt-4o-mini", messages=QUESTION, max_tokens=24)
    assert "Paris" in out.choices[0].message.content


def test_anthropic_client_gets_paris_and_a_cache_read(server_url):
    client = anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0)
    for _ in range(2):  # the second time the question's tokens are cached
        with client.messages.stream(
            model="claude-local", messages=QUESTION, max_tokens=24
        ) as stream:
            text = "".join(stream.text_stream)
            usage = stream.get_final_message().usage
        assert "Paris" in text
    assert usage.cache_read_input_tokens > 0
