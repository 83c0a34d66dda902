"""A model sharded over 2 processes (`mlx.launch --backend ring` on this machine), tensor
parallel or pipeline, answers a chat like one process (tokens and log-probabilities), and both
ranks' cache entries stay equal through trims, misses and cancels. Reference: the same script
run in one process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlxkv.errors import NotSupportedError
from mlxkv.models.sharding import shard_model
from mlxkv.testing.factory import build_model
from tests.factories import tiny_model_dir

SCRIPT = Path(__file__).with_name("chat_script.py")
ROOT = Path(__file__).resolve().parents[2]
CHAT_TURNS = 3
_TIMEOUT_S = 120
_LOGPROB_RTOL = 1e-4  # CPU float32's bound on logits (tests/tolerances.py); seen 4.8e-6
# A Qwen2 whose 3 KV heads do not split over 2 ranks: sharded as a pipeline, a layer a rank.
_PIPELINE = {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}


def launcher() -> str:
    found = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
    if not Path(found).exists():
        pytest.skip("mlx.launch is not installed")
    return found


def ring(ranks: int) -> list[str]:
    """`mlx.launch` over the ring backend on ports free now: its default ports (32323 on) are
    every run's, so a sharded run beside another on this machine failed ("Couldn't bind
    socket"), with exit status 0."""
    return [
        launcher(),
        "-n",
        str(ranks),
        "--backend",
        "ring",
        "--starting-port",
        str(_free_ports(ranks)),
    ]


def _free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports that are free now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65536:
            continue
        try:
            with contextlib.ExitStack() as held:
                for port in range(first, first + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free loopback ports")


def _run(command: list[str], model: Path, out_dir: Path, ranks: int) -> list[list[dict]]:
    out_dir.mkdir()
    process = subprocess.Popen(
        [*command, str(SCRIPT), str(model), str(out_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # its own process group: the ranks too are stopped on timeout
    )
    try:
        output, _ = process.communicate(timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"ranks out of step: no end in {_TIMEOUT_S} s\n{output}")
    assert process.returncode == 0, output
    files = sorted(out_dir.glob("rank*.json"))
    assert len(files) == ranks, output  # mlx.launch exits 0 also when a rank failed
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2_pipeline"])
def runs(request, model_root, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2_pipeline":
        model = build_model("qwen2", tmp_path / "model", config_overrides=_PIPELINE)
    else:
        model = tiny_model_dir(request.param, model_root)
    single = _run([sys.executable], model, tmp_path / "single", ranks=1)
    launched = [*ring(2), sys.executable]
    sharded = _run(launched, model, tmp_path / "sharded", ranks=2)
    return single[0], sharded


def _assert_logprobs_close(got: list, want: list, what: str) -> None:
    """Each token's log-probability and its likeliest alternatives (ids equal, values within
    `_LOGPROB_RTOL`)."""
    assert len(got) == len(want), what
    for (logprob, top), (want_logprob, want_top) in zip(got, want, strict=True):
        assert [t for t, _ in top] == [t for t, _ in want_top], what
        alternatives = zip(top, want_top, strict=True)
        pairs = [(logprob, want_logprob), *((v, w) for (_, v), (_, w) in alternatives)]
        for value, expected in pairs:
            assert abs(value - expected) <= _LOGPROB_RTOL * max(1.0, abs(expected)), what


def test_two_ranks_answer_the_chat_as_one_process_does(runs):
    single, (rank0, rank1) = runs
    for turn in range(CHAT_TURNS):
        assert rank0[turn]["tokens"] == single[turn]["tokens"], f"turn {turn}"
        assert rank0[turn]["cached"] == single[turn]["cached"], f"turn {turn}"
        assert len(single[turn]["logprobs"]) == len(single[turn]["tokens"])
        _assert_logprobs_close(rank0[turn]["logprobs"], single[turn]["logprobs"], f"turn {turn}")
    assert single[1]["cached"] > 0 and single[2]["cached"] > single[1]["cached"]
    # tensor parallel: every rank has every layer; pipeline: its own of them
    layers = [single[0]["layers"], rank0[0]["layers"], rank1[0]["layers"]]
    assert layers in ([2, 2, 2], [2, 1, 1])


def test_two_ranks_score_a_prompt_as_one_process_does(runs):
    """The prompt's own log-probabilities, its cached prefix fed again on every rank."""
    single, (rank0, _) = runs
    assert single[-1]["cached"] > 0 and rank0[-1]["cached"] == single[-1]["cached"]
    assert single[-1]["logprobs"], "no prompt log-probabilities"
    _assert_logprobs_close(rank0[-1]["logprobs"], single[-1]["logprobs"], "the scored prompt")


def test_both_ranks_hold_the_same_tokens_and_half_the_bytes_after_every_request(runs):
    single, (rank0, rank1) = runs
    assert len(rank0) == len(rank1) == len(single) == CHAT_TURNS + 9
    for i, (one, zero, other) in enumerate(zip(single, rank0, rank1, strict=True)):
        assert zero["held"] == other["held"], f"request {i}"
        if zero["text"] is not None:  # the same text, a raw prompt's first space too (stop
            assert zero["text"] == other["text"], f"request {i}"  # strings are matched on it)
        if i != CHAT_TURNS + 4:  # the sampled one draws a seed of its own
            assert zero["held"] == one["held"], f"request {i}"
        assert zero["allocated_bytes"] == other["allocated_bytes"], f"request {i}"
        assert 2 * zero["allocated_bytes"] == one["allocated_bytes"], f"request {i}"
    trim, miss, left, cancelled, sampled, dropped, freed, _, _ = rank1[CHAT_TURNS:]
    assert 0 < trim["cached"] < len(rank1[CHAT_TURNS - 1]["held"])  # went back: a trim
    assert miss["cached"] == 0
    assert left["finish"] == cancelled["finish"] == "cancelled"  # rank 1 stopped with rank 0
    assert sampled["tokens"] == rank0[CHAT_TURNS + 4]["tokens"]  # the same draws on both ranks
    assert dropped["cached"] == rank0[CHAT_TURNS + 5]["cached"] == 0  # dropped on both ranks
    # a request made before its key was dropped: its entry freed on both ranks when it ended
    assert freed["cached"] > 0 and freed["held"] == rank0[CHAT_TURNS + 6]["held"] == []


def test_an_architecture_without_sharding_is_refused_by_name(load_tiny):
    model, _ = load_tiny("gemma3_text")
    with pytest.raises(NotSupportedError, match="'gemma3_text' models cannot be sharded"):
        shard_model(model, mx.distributed.init(), "gemma3_text")


def test_heads_that_do_not_divide_over_the_ranks_are_refused_by_count(load_tiny):
    """SmolLM2-135M has 3 KV heads: over 2 processes MLX failed with a shape error."""
    model, _ = load_tiny("llama")
    two_ranks = SimpleNamespace(size=lambda: 2)
    config = {"num_attention_heads": 9, "num_key_value_heads": 3}
    with pytest.raises(NotSupportedError, match="its 3 KV heads cannot be split evenly"):
        shard_model(model, two_ranks, "llama", config)
