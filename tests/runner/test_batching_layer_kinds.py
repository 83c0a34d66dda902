"""Batched streams on models whose cache layers cannot all trim back: sliding windows (Gemma 3
with global layers beside, every layer a window in spark2_5; windows of 8 tokens, so they wrap
in these replies) and recurrent state (LFM2 beside attention, Mamba alone); and on K/V
quantized to 8 and 4 bits (`kv_bits`, mlxkv's own batched class: llama-q8, llama-q4, against a
fresh Runner with the same `kv_bits`). Against each request alone on a fresh Runner, by tokens
and log-probabilities: rows of different prompt
lengths joining and leaving at different steps, one reader stopping with tokens decoded ahead
that it never read; the next turn of that conversation reusing what its entry kept; a batched
reply crossing a disk-tier block boundary restoring from the snapshot there. Every entry is
checked after every request by `tests/invariants.py` (`tests/conftest.py`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mlxkv import Runner
from mlxkv.runner.disk.chains import BLOCK_TOKENS
from tests.factories import InStep
from tests.runner.test_batching import _assert_same_answers, _in_step, _queued_then_run

OPTIONS = {"max_tokens": 24, "temperature": 0.0, "logprobs": 0}
LENGTHS = (20, 45, 9, 70)  # prompt tokens of the four streams
READ_FIRST = 3  # chunks the slow reader takes before it falls behind
READ_AHEAD = 12  # chunks another stream reads meanwhile (each a step the slow row is fed)


def _tokens(seed: int, count: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 500, count)]


def _answer(chunks) -> tuple[list[int], list[float]]:
    chunks = list(chunks)
    tokens = [c.token for c in chunks if c.token is not None]
    return tokens, [c.logprob.logprob for c in chunks if c.logprob is not None]


def _alone(loaded, prompt, settings=None):
    fresh = Runner(loaded, max_context=512, speculative=None, **(settings or {}))
    return _answer(fresh.stream(prompt, **OPTIONS))


def _model(loaded_tiny, loaded_quantizable, case: str):
    """(LoadedModel, Runner settings) of a case: an architecture, or llama-q<bits> (K/V
    quantized in groups of 64, the quantizable llama's head dimension)."""
    if case.startswith("llama-q"):
        return loaded_quantizable, {"kv_bits": int(case[len("llama-q") :]), "kv_group_size": 64}
    return loaded_tiny(case), {}


@pytest.mark.parametrize(
    "arch", ["gemma3_text", "spark2_5", "lfm2", "mamba", "llama-q8", "llama-q4"]
)
def test_rows_of_every_layer_kind_decode_as_alone_and_a_slow_reader_leaves_exact(
    loaded_tiny, loaded_quantizable, arch, rows
):
    loaded, settings = _model(loaded_tiny, loaded_quantizable, arch)
    bits = settings.get("kv_bits")
    prompts = [_tokens(seed, n) for seed, n in enumerate(LENGTHS)]
    want = [_alone(loaded, prompt, settings) for prompt in prompts]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4, **settings)
    results: list = [None] * len(prompts)
    ahead, slow_left = threading.Event(), threading.Event()
    step = InStep(len(prompts))  # all four rows in the batch before the slow one falls behind

    def slow():  # falls behind while another stream reads on, then goes away
        stream = step.read(0, runner.stream(prompts[0], batched=True, **OPTIONS))
        chunks = [next(stream) for _ in range(READ_FIRST)]
        assert ahead.wait(30)
        chunks.append(next(stream))
        stream.close()
        slow_left.set()
        results[0] = _answer(chunks)

    def reader(i):
        chunks = []
        for chunk in step.read(i, runner.stream(prompts[i], batched=True, **OPTIONS)):
            chunks.append(chunk)
            if len(chunks) == READ_FIRST + READ_AHEAD:
                if i == 1:
                    ahead.set()
                # every reader waits here till the slow one has left: the tokens it is fed
                # ahead (which a full window keeps) are bounded by the steps, not the clock
                assert slow_left.wait(30)
        results[i] = _answer(chunks)

    _queued_then_run(runner, [slow, *(lambda i=i: reader(i) for i in (1, 2, 3))])
    assert max(rows) == len(prompts), "the streams never decoded all together"
    _assert_same_answers(results[1:], want[1:], bits)
    slow_tokens, slow_logprobs = results[0]
    assert len(slow_tokens) == READ_FIRST + 1
    _assert_same_answers([(slow_tokens, slow_logprobs)], [_prefix(want[0], READ_FIRST + 1)], bits)
    # the slow reader's next turn: what it read of its reply, then a new message
    turn = prompts[0] + slow_tokens + _tokens(9, 10)
    again = runner.stream(turn, batched=True, **OPTIONS)
    got = _answer(again_chunks := list(again))
    _assert_same_answers([got], [_alone(loaded, turn, settings)], bits)
    cached = again_chunks[-1].completion.cached_tokens
    if arch not in ("gemma3_text", "spark2_5"):  # K/V trimmed (recurrent state went back) to
        # what the reader read
        assert cached >= len(prompts[0]) + len(slow_tokens) - 1
    else:  # full windows cannot go back over one token: the entry kept the tokens decoded
        # ahead, and the next turn goes back to the checkpoint where the reply starts
        assert cached >= len(prompts[0]) - 1


def _prefix(answer, count):
    tokens, logprobs = answer
    return tokens[:count], logprobs[:count]


@pytest.mark.parametrize("arch", ["lfm2", "gemma3_text"])
def test_a_batched_reply_that_crosses_a_boundary_is_snapshotted_there(
    loaded_tiny, tmp_path, arch, rows
):
    """As tests/runner/test_disk_snapshots.py's plain reply: the boundary falls 12 tokens into
    the reply, decoded in the batch beside a short stream."""
    loaded = loaded_tiny(arch)
    stored = _tokens(9, 2 * BLOCK_TOKENS - 12)
    options = {"max_tokens": 30, "temperature": 0.0}
    config = {"max_context": 2048, "cache_entries": 8, "max_batch": 4, "cache_dir": tmp_path}
    before = Runner(loaded, **config)
    read = _in_step(before, [stored, _tokens(5, 12)], **options)
    replies = [runner_tokens(chunks) for chunks in read]
    assert max(rows) == 2
    before.close()
    prompt = stored + replies[0][:20] + _tokens(10, 30)  # diverges 8 tokens past the boundary
    short = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0}
    after = list(Runner(loaded, **config).stream(prompt, **short))
    fresh = Runner(loaded, max_context=2048, speculative=None)
    _assert_same_answers([_answer(after)], [_answer(fresh.stream(prompt, **short))])
    assert after[-1].completion.cached_tokens == 2 * BLOCK_TOKENS


def runner_tokens(chunks) -> list[int]:
    return [c.token for c in chunks if c.token is not None]
