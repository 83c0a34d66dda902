"""`mlxkv serve` killed with SIGKILL (the OOM killer, a crash, `kill -9`) at seeded random
moments, mid-reply and mid-write, and restarted on the same disk tier, round after round: each
server starts, logs no traceback, loads no torn file, answers every conversation exactly as a
server without a disk tier that generated the same replies and never restarted, and
conversations that finished (their writes given a few seconds) restart warm: their whole first
turn, the reply included, comes from the disk tier (a reply that re-tokenizes otherwise than
generated renders as its generated ids after a restart too: `mlxkv.runner.disk.replies`)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from tests.factories import tiny_model_dir
from tests.processes import ready_url

ROOT = Path(__file__).resolve().parents[2]
_TIMEOUT_S = 120
_ROUNDS = 4  # kills, each at a moment drawn from the seeded generator
_SEED = 40
# A finished turn is on disk within this long (the issue asks for "a couple of seconds").
_DURABLE_S = 5.0
# Logprobs of K/V loaded from disk against K/V prefilled: same arrays, another chunking.
_LOGPROB_ATOL = 1e-3


class _Server:
    """`mlxkv serve` as a subprocess, with a client."""

    def __init__(self, model: str, cache_dir: Path | None):
        # two entries in memory with a disk tier (evictions go to disk too); else the
        # server's default entries, holding every conversation, and no disk tier at all
        disk = ["--cache-dir", str(cache_dir), "--cache-entries", "2"] if cache_dir else []
        disk = disk or ["--no-cache-dir"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlxkv.cli", "serve", "-m", model, "--port", "0",
             "--no-warmup", *disk],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
        self.url = ready_url(self.process, _TIMEOUT_S)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def cache_report(self) -> dict:
        """`GET /v1/mlxkv/cache`: `Runner.cache_info()` as JSON."""
        with urllib.request.urlopen(f"{self.url}/v1/mlxkv/cache", timeout=_TIMEOUT_S) as reply:
            return json.load(reply)

    def ask(self, messages: list[dict], max_tokens: int = 6):
        return self.client.chat.completions.create(
            model="m", messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True
        )

    def stop(self, kill: bool) -> str:
        """Kills it (SIGKILL) or stops it (SIGTERM); returns its stderr."""
        self.process.kill() if kill else self.process.terminate()
        _, stderr = self.process.communicate(timeout=_TIMEOUT_S)
        return stderr


def _assert_same_answer(got, want) -> None:
    assert got.choices[0].message.content == want.choices[0].message.content
    got_lp = [t.logprob for t in got.choices[0].logprobs.content]
    want_lp = [t.logprob for t in want.choices[0].logprobs.content]
    worst = max((abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)), default=0.0)
    assert worst <= _LOGPROB_ATOL, f"max |logprob difference| {worst:.2e}"


def _wait_for_writes(server: _Server) -> bool:
    """True once the server reports no disk write pending (`disk_pending_writes` in
    `/v1/mlxkv/cache`) within `_DURABLE_S`: a turn queues its writes before its reply is sent,
    so at 0 every turn answered is on disk."""
    deadline = time.monotonic() + _DURABLE_S
    while time.monotonic() < deadline:
        if server.cache_report()["disk_pending_writes"] == 0:
            return True
        time.sleep(0.02)  # another process: polled
    return False


def _kill_mid_reply(server: _Server, rng: random.Random) -> None:
    """A long streamed reply, killed after a random number of its chunks."""
    after_chunks = rng.randint(0, 40)
    prompt = " ".join(f"word{rng.randint(0, 999)}" for _ in range(rng.randint(50, 400)))
    stream = server.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=400, stream=True
    )
    for seen, _ in enumerate(stream):
        if seen >= after_chunks:
            break
    server.process.kill()


def _kill_mid_write(server: _Server, rng: random.Random) -> None:
    """A turn that ends, killed as its write behind starts."""
    server.ask([{"role": "user", "content": f"A short one, number {rng.randint(0, 999)}."}])
    server.process.kill()


def _assert_clean(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert "removed" not in stderr, stderr  # a file of its own found torn or corrupt


def test_kill_9_at_random_moments_then_restart_answers_exactly_and_warm(model_root, tmp_path):
    model = str(tiny_model_dir("llama", model_root))
    rng = random.Random(_SEED)
    cache_dir = tmp_path / "kv"
    reference = _Server(model, None)
    # conversations whose turn ended and was written, with their first turn's tokens (the
    # prompt and the reply)
    finished: list[tuple[list[dict], int]] = []
    try:
        for round_ in range(_ROUNDS + 1):
            server = _Server(model, cache_dir)
            try:
                for index, (messages, turn_tokens) in enumerate(finished):
                    follow_up = messages + [{"role": "user", "content": "And then?"}]
                    # the reference generated the same replies and never restarted: a reply
                    # sent back renders as its generated ids there, and here from the disk
                    # tier's records (`mlxkv.runner.disk.replies`)
                    got, want = server.ask(follow_up), reference.ask(follow_up)
                    _assert_same_answer(got, want)
                    # warm: the whole first turn comes from the disk tier (less the reply's
                    # last token, which a reply cut by max_tokens never fed)
                    cached = got.usage.prompt_tokens_details.cached_tokens
                    assert cached >= turn_tokens - 1, (round_, index, cached, turn_tokens)
                if round_ < _ROUNDS:  # the last round only checks
                    messages = [
                        {"role": "system", "content": f"You are assistant {round_}. Be brief."},
                        {"role": "user", "content": f"Name {rng.randint(2, 9)} rivers."},
                    ]
                    got = server.ask(messages)
                    _assert_same_answer(got, reference.ask(messages))
                    assert _wait_for_writes(server)
                    reply = {"role": "assistant", "content": got.choices[0].message.content}
                    turn_tokens = got.usage.prompt_tokens + got.usage.completion_tokens
                    finished.append((messages + [reply], turn_tokens))
                    (_kill_mid_reply if rng.random() < 0.5 else _kill_mid_write)(server, rng)
            finally:
                killed = server.process.poll() is not None
                stderr = server.process.communicate()[1] if killed else server.stop(kill=False)
            _assert_clean(stderr)
    finally:
        reference.stop(kill=True)
