"""A rank frozen (SIGSTOP) mid-reply, most often while the others are inside a forward pass
(waiting in the sharded layers' own all_sum, where MLX's wait has no deadline), fails the
server in bounded time: rank 0's open streams end with the API's error event naming
MLXKV_RANK_TIMEOUT_S, /health stops saying ok, and the rank still running exits with status
1, `mlx.launch` saying so. It used to hang: rank 0 waited in MLX's ring all_reduce (its
engine thread in `mx.synchronize`), the stream open with keep-alives, every later request
hung, /health "ok"; a follower whose rank 0 froze lingered likewise. The steps are timed, not
the request: the reply streams for over twice the timeout before the freeze. (A rank stuck
inside its forward pass for certain: `test_rank_faults.py`, `stall`.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from mlxkv.models.loading import load_model
from tests.factories import tiny_model_dir, wait_until
from tests.processes import ready_url

from .test_sharded import ROOT, ring

_RANK_TIMEOUT_S = 3
_GRACE_S = 30  # far above the rank timeout: the rank still running has exited by then

# Why the rank still running fails, in its log line and every error: the step that waited
# past the timeout (in a forward pass: the watchdog's; at the ranks' own collective, a cancel
# check or a request's broadcast, if that is where the other froze: that wait's own bound).
_WHY = re.compile(
    rf"rank (\d): (one step of the sharded model \(a prefill chunk or a decode step\) ran "
    rf"past MLXKV_RANK_TIMEOUT_S={_RANK_TIMEOUT_S} s|the other ranks did not answer within "
    rf"{_RANK_TIMEOUT_S} s).*: restart every rank"
)
_CHAT = [{"role": "user", "content": "Tell me a long story"}]


def _rank_pids(group: int) -> dict[int, int]:
    """MLX rank -> pid of the processes in process group `group` (mlx.launch sets MLX_RANK)."""
    found = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(name)) != group:
                continue
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"MLX_RANK="):
                found[int(entry[len(b"MLX_RANK=") :])] = int(name)
    return found


class _Sharded:
    """`mlxkv serve` on a tiny model under `mlx.launch -n 2`, in a process group of its own;
    `said` holds what every rank and mlx.launch said on stderr."""

    def __init__(self, model_root):
        model = tiny_model_dir("llama", model_root)
        self.eos_token_ids = load_model(model).tokenizer.eos_token_ids
        self.process = subprocess.Popen(
            [*ring(2), "--", sys.executable, "-m",
             "mlxkv.cli", "serve", "-m", str(model), "--port", "0", "--no-cache-dir",
             "--max-context", "8192"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            start_new_session=True,
            env={**os.environ, "MLXKV_RANK_TIMEOUT_S": str(_RANK_TIMEOUT_S)},
        )  # fmt: skip
        try:
            self.url = ready_url(self.process, 120)
        except BaseException:
            self.stop()
            raise
        self.said: list[str] = []  # every rank's stderr lines, and mlx.launch's
        self._reader = threading.Thread(target=self._read_stderr)
        self._reader.start()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)
        self.pids = _rank_pids(self.process.pid)

    def _read_stderr(self) -> None:
        for line in self.process.stderr:  # until every process of the group has ended
            self.said.append(line)

    def stream_then_freeze(self, rank: int) -> openai.Stream:
        """A long reply, read until it has streamed for over twice the rank timeout (many
        steps, none of them slow), then `rank` is frozen (SIGSTOP); the rest unread."""
        stream = self.client.chat.completions.create(
            model="m",
            messages=_CHAT,
            max_tokens=6000,
            stream=True,
            logit_bias={str(eos): -100 for eos in self.eos_token_ids},  # a reply that goes on
        )
        start = time.monotonic()
        for n, _ in enumerate(stream):
            if n >= 5 and time.monotonic() - start > 2 * _RANK_TIMEOUT_S:
                os.kill(self.pids[rank], signal.SIGSTOP)
                return stream
        raise AssertionError("the reply ended before it had streamed that long")

    def exited(self, rank: int) -> None:
        """Waits until `rank` has exited with status 1 (its exit seen by mlx.launch)."""
        said = f"Node with rank {rank} exited with code 1"
        wait_until(lambda: any(said in line for line in self.said), _GRACE_S, said)

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)  # SIGKILL ends stopped processes too
        self.process.wait()
        if hasattr(self, "_reader"):
            self._reader.join()


def _error_event(stream: openai.Stream) -> str:
    """The message of the error event `stream` ends with (its chunks read to the end)."""
    with pytest.raises(openai.APIError) as raised:
        for _ in stream:
            pass
    return str(raised.value)


def test_a_follower_frozen_mid_stream_fails_the_streams_and_rank_0_exits(model_root):
    server = _Sharded(model_root)
    try:
        stream = server.stream_then_freeze(1)
        # queued behind it (sharded, one generation at a time): its headers are sent
        waiting = server.client.chat.completions.create(
            model="m", messages=_CHAT, max_tokens=8, stream=True
        )
        ended = threading.Event()
        errors: list[str] = []
        threading.Thread(
            target=lambda: errors.append(_error_event(stream)) or ended.set(), daemon=True
        ).start()
        assert ended.wait(_GRACE_S), f"the stream still open {_GRACE_S} s after rank 1 froze"
        why = _WHY.search(errors[0])
        assert why and why.group(1) == "0", errors[0]
        assert why.group(0) in _error_event(waiting)
        try:  # 503 until the server has stopped listening
            health = httpx.get(server.url + "/health", timeout=_GRACE_S)
            assert health.status_code == 503 and why.group(0) in health.json()["error"]
        except httpx.ConnectError:
            pass
        server.exited(0)
    finally:
        server.stop()
    said = "".join(server.said)
    assert [w.group(1) for w in _WHY.finditer(said)] == ["0"], said[-3000:]  # one line


def test_rank_0_frozen_mid_stream_ends_the_follower(model_root):
    server = _Sharded(model_root)
    try:
        server.stream_then_freeze(0)  # the rest of the reply is never read
        server.exited(1)
    finally:
        server.stop()
    said = "".join(server.said)
    assert [w.group(1) for w in _WHY.finditer(said)] == ["1"], said[-3000:]  # one line
