"""`mlxkv serve` with a disk tier killed with SIGKILL while several conversations decode
together (a decode batch; the disk tier snapshots each row's state in batched steps), right
after a turn ends and while a turn's write behind is in flight, on a plain model and a hybrid
one (LFM2: recurrent state restored only where a snapshot was taken). After each restart the
server logs no traceback and removes nothing, every conversation that finished answers its
next turn exactly as a server without a disk tier and warm (its whole first turn from disk),
a Runner in this process opening the directory holds what it fed (the suite's invariants),
and files the tier did not write are still there."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from tests.factories import tiny_model_dir
from tests.server.test_serve_kill import _assert_clean, _assert_same_answer, _Server
from tests.server.test_serve_kill import _wait_for_writes as _writes_done

_STREAMS = 3
_WRITE_WAIT_S = 5.0


def _conversation(arch: str, index: int) -> list[dict]:
    return [
        {"role": "system", "content": f"You are assistant {index} of {arch}. Be brief."},
        {"role": "user", "content": " ".join(f"fact{index}-{n}" for n in range(40 + 9 * index))},
    ]


def _together(server: _Server, conversations: list[list[dict]], max_tokens: int) -> list:
    """The conversations' turns sent at once (the server decodes them in one batch)."""
    answers: list = [None] * len(conversations)
    start = threading.Barrier(len(conversations))

    def ask(i: int) -> None:
        start.wait()
        answers[i] = server.ask(conversations[i], max_tokens=max_tokens)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(conversations))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def _kill_mid_batch(server: _Server) -> None:
    """Three long streams at once, killed once each has sent a few chunks."""
    seen = threading.Barrier(_STREAMS + 1)

    def stream(i: int) -> None:
        chunks = server.client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Go on forever, {i}."}],
            max_tokens=400, stream=True,
        )  # fmt: skip
        try:
            for count, _ in enumerate(chunks):
                if count == 3:
                    seen.wait(timeout=60)
        except Exception:  # noqa: BLE001 - the server is killed mid-stream
            return

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(_STREAMS)]
    for thread in threads:
        thread.start()
    seen.wait(timeout=60)
    server.process.kill()


def _kill_during_write(server: _Server, cache_dir: Path, messages: list[dict]) -> bool:
    """A turn that ends, killed while its write behind has a temporary file open; False if the
    write finished before a temporary file was seen (then killed after it)."""
    server.ask(messages)
    pid = server.process.pid
    deadline = time.monotonic() + _WRITE_WAIT_S
    while time.monotonic() < deadline:  # polled without a pause: the write takes a few ms
        if any(p.name.startswith(f".tmp-{pid}-") for p in cache_dir.glob("*/.tmp-*")):
            server.process.kill()
            return True
    server.process.kill()
    return False


def _plant_foreign(cache_dir: Path) -> list[Path]:
    """Files the tier did not write, beside its own: notes, another program's safetensors
    named like a block, and temporary files of a live process and of a gone one, fresh."""
    planted = [cache_dir / "notes.txt"]
    for model_dir in (d for d in cache_dir.iterdir() if d.is_dir()):
        other = model_dir / f"{uuid.uuid4().hex}.safetensors"
        mx.save_safetensors(str(other), {"w": mx.zeros((4,))}, metadata={"format": "mlx"})
        planted += [other, model_dir / "README"]
        planted += [model_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex}.safetensors"]
        planted += [model_dir / f".tmp-{2**22 + 7}-{uuid.uuid4().hex}.safetensors"]
    for path in planted:
        if not path.exists():
            path.write_bytes(b"not the disk tier's")
    return planted


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_kill_9_mid_batch_after_a_turn_and_mid_write(arch, model_root, tmp_path):
    model = str(tiny_model_dir(arch, model_root))
    cache_dir = tmp_path / "kv"
    cache_dir.mkdir()
    reference = _Server(model, None)
    finished: list[tuple[list[dict], int]] = []  # conversations written, their turn's tokens
    planted: list[Path] = []
    try:
        for round_ in range(4):
            server = _Server(model, cache_dir)
            try:
                for messages, turn_tokens in finished:
                    follow_up = messages + [{"role": "user", "content": "And then?"}]
                    got, want = server.ask(follow_up), reference.ask(follow_up)
                    _assert_same_answer(got, want)
                    cached = got.usage.prompt_tokens_details.cached_tokens
                    assert cached >= turn_tokens - 1, (arch, round_, cached, turn_tokens)
                if round_ == 0:  # three conversations decoded together, written, then a kill
                    conversations = [_conversation(arch, i) for i in range(_STREAMS)]
                    answers = _together(server, conversations, max_tokens=24)
                    assert _writes_done(server)
                    for messages, got in zip(conversations, answers, strict=True):
                        _assert_same_answer(got, reference.ask(messages, max_tokens=24))
                        reply = {"role": "assistant", "content": got.choices[0].message.content}
                        tokens = got.usage.prompt_tokens + got.usage.completion_tokens
                        finished.append((messages + [reply], tokens))
                    planted = _plant_foreign(cache_dir)
                    _kill_mid_batch(server)
                elif round_ == 1:  # killed right after a turn ends (that turn may be lost)
                    server.ask(_conversation(arch, 7))
                    server.process.kill()
                elif round_ == 2:
                    _kill_during_write(server, cache_dir, _conversation(arch, 40))
            finally:
                killed = server.process.poll() is not None
                stderr = server.process.communicate()[1] if killed else server.stop(kill=False)
            _assert_clean(stderr)
            assert all(p.exists() for p in planted), [p.name for p in planted if not p.exists()]
    finally:
        reference.stop(kill=True)
    # The directory opened in this process: the suite's invariants check what it restores.
    # loaded afresh, as a restarted process has it: the session's shared model holds other
    # tests' replies in its reply memory, newer than those restored from the disk tier
    runner = Runner(load_model(model), cache_dir=cache_dir)
    try:
        for messages, turn_tokens in finished:
            follow_up = messages + [{"role": "user", "content": "And then?"}]
            assert runner.generate(follow_up, max_tokens=4).cached_tokens >= turn_tokens - 1
    finally:
        runner.close()
    assert all(path.exists() for path in planted)
