"""`mlxkv generate`, `chat` and `serve` under `mlx.launch -n 2 --backend ring`: rank 0 alone
prints and serves, and the answers are one process's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import openai
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from tests.factories import tiny_model_dir
from tests.processes import ready_url

from .test_sharded import ROOT, ring

_TIMEOUT_S = 120


def _cli(args: list[str], *, ranks: int, stdin: str | None = None) -> subprocess.CompletedProcess:
    prefix = [*ring(ranks), "--"] if ranks > 1 else []
    return subprocess.run(
        [*prefix, sys.executable, "-m", "mlxkv.cli", *args],
        input=stdin, capture_output=True, text=True, timeout=_TIMEOUT_S, cwd=ROOT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model(model_root) -> str:
    return str(tiny_model_dir("llama", model_root))


def test_generate_prints_once_what_one_process_prints(model):
    args = ["generate", "-m", model, "-p", "Hello there", "--max-tokens", "12"]
    single, sharded = _cli(args, ranks=1), _cli(args, ranks=2)
    assert single.returncode == sharded.returncode == 0, sharded.stderr
    assert single.stdout.strip() and sharded.stdout == single.stdout


def test_chat_through_a_pipe_answers_as_one_process(model):
    args = ["chat", "-m", model, "--max-tokens", "10", "--verbose"]
    # mlx.launch forwards input but never its end: /quit ends the chat.
    lines = "Hello\nTell me more\nAnd then?\n/quit\n"
    single, sharded = _cli(args, ranks=1, stdin=lines), _cli(args, ranks=2, stdin=lines)
    assert single.returncode == sharded.returncode == 0, sharded.stderr
    assert sharded.stdout == single.stdout, sharded.stderr  # its log says what rank 0 did
    cached = [int(n) for n in re.findall(r"cached (\d+) \|", sharded.stderr)]
    assert cached == [int(n) for n in re.findall(r"cached (\d+) \|", single.stderr)]
    assert len(cached) == 3 and cached[2] > cached[1] > 0
    assert "(rank 0 of 2; all ranks:" in sharded.stderr
    assert "(rank 1 of 2" not in sharded.stderr  # rank 1 prints nothing


def test_serve_answers_on_rank_0_as_one_process(model):
    process = subprocess.Popen(
        [*ring(2), "--", sys.executable, "-m", "mlxkv.cli",
         "serve", "-m", model, "--port", "0", "--no-cache-dir"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    try:
        client = openai.OpenAI(
            base_url=ready_url(process, _TIMEOUT_S) + "/v1", api_key="x", max_retries=0
        )
        reference = Runner(load_model(model))
        chat = [{"role": "user", "content": "Hello"}]
        for turn in range(2):
            got = client.chat.completions.create(model="m", messages=chat, max_tokens=10)
            want = reference.generate(chat, max_tokens=10)
            assert got.choices[0].message.content == want.text, f"turn {turn}"
            cached = got.usage.prompt_tokens_details.cached_tokens
            assert cached == want.cached_tokens and (turn == 0 or cached > 0)
            chat.append({"role": "assistant", "content": want.text})
            chat.append({"role": "user", "content": "Go on"})
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
