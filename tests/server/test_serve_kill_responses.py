"""`mlxkv serve` killed with SIGKILL right after it answered, then started again on the same
disk tier directory: its stored responses and conversations are there (`responses/` beside the
K/V), through the real `openai` client, and a turn after the restart answers as a fresh Runner
given the whole conversation (log-probabilities). Before, a restart forgot them: 400
`previous_response_not_found` and 404s."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.factories import tiny_model_dir
from tests.processes import ready_url

ROOT = Path(__file__).resolve().parents[2]
_TIMEOUT_S = 120
MAX_TOKENS = 6
ASK = {
    "model": "m",
    "max_output_tokens": MAX_TOKENS,
    "include": ["message.output_text.logprobs"],
    "temperature": 0,
}


def _start(model: str, cache_dir: Path) -> tuple[subprocess.Popen, openai.OpenAI]:
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxkv.cli", "serve", "-m", model, "--port", "0",
         "--no-warmup", "--cache-dir", str(cache_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    url = ready_url(process, _TIMEOUT_S)
    return process, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _stop(process: subprocess.Popen, kill: bool) -> str:
    process.kill() if kill else process.terminate()
    return process.communicate(timeout=_TIMEOUT_S)[1]


def _logprobs(response) -> list[float]:
    return [token.logprob for token in response.output[0].content[0].logprobs]


def test_kill_9_keeps_what_was_answered(model_root, fresh_runner, tmp_path):
    model = str(tiny_model_dir("llama", model_root))
    process, client = _start(model, tmp_path / "kv")
    try:
        first = client.responses.create(**ASK, input="Once upon a time")
        conversation = client.conversations.create(items=[{"role": "user", "content": "Hi"}])
        turn = client.responses.create(**ASK, input="Hello", conversation=conversation.id)
    finally:
        stderr = _stop(process, kill=True)  # at once: nothing waited for
    assert "Traceback" not in stderr, stderr

    process, client = _start(model, tmp_path / "kv")
    try:
        assert client.responses.retrieve(first.id).output_text == first.output_text
        chained = client.responses.create(**ASK, input="And then", previous_response_id=first.id)
        continued = client.responses.create(**ASK, input="Again", conversation=conversation.id)
        items = client.conversations.items.list(conversation.id, order="asc").data
    finally:
        stderr = _stop(process, kill=False)
    assert "Traceback" not in stderr and "memory only" not in stderr, stderr
    assert f"conversations in {tmp_path / 'kv' / 'responses'} (3 read)" in stderr, stderr
    assert len(items) == 5 and items[2].id == turn.output[0].id  # both turns, in order

    def fresh(first_turn: list[dict], reply: str, question: str) -> list[float]:
        """A fresh Runner's, having made the first turn's reply itself: it renders the reply
        as the ids it generated, as the restarted server does from its disk tier."""
        reference = fresh_runner()
        assert reference.generate(first_turn, max_tokens=MAX_TOKENS, temperature=0).text == reply
        asked = [*first_turn, {"role": "assistant", "content": reply}]
        asked += [{"role": "user", "content": question}]
        chunks = reference.stream(asked, max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
        return [chunk.logprob.logprob for chunk in chunks if chunk.logprob is not None]

    asked = [{"role": "user", "content": "Once upon a time"}]
    want = fresh(asked, first.output_text, "And then")
    assert _logprobs(chained) == pytest.approx(want, abs=1e-3)
    asked = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello"}]
    want = fresh(asked, turn.output_text, "Again")
    assert _logprobs(continued) == pytest.approx(want, abs=1e-3)
