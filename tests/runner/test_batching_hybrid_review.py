"""Review probes of batched windows and recurrent state (merge fd1e4a3) through a Runner, each
request checked by tests/invariants.py after it ends (`tests/conftest.py`)."""

from __future__ import annotations

import threading

import pytest

from mlxkv import Runner
from tests.runner.test_batching import _assert_same_answers, _queued_then_run
from tests.runner.test_batching_layer_kinds import OPTIONS, _alone, _answer, _prefix, _tokens


@pytest.mark.parametrize("arch", ["gemma3_text", "lfm2"])
def test_a_reader_far_behind_stops_and_its_entry_holds_what_it_streamed(loaded_tiny, arch, rows):
    """As test_batching_layer_kinds' slow reader, but 30 steps behind instead of 12 (a client
    reading slowly while another reads on): the entry may hold at most 17 tokens past what
    its request streamed (tests/invariants.py), and the next turn answers as alone."""
    loaded = loaded_tiny(arch)
    options = {**OPTIONS, "max_tokens": 40}
    prompts = [_tokens(20, 25), _tokens(21, 40)]
    want = [_alone(loaded, p, **options) for p in prompts]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    results: list = [None, None]
    ahead = threading.Event()

    def slow():
        stream = runner.stream(prompts[0], batched=True, **options)
        chunks = [next(stream) for _ in range(3)]
        assert ahead.wait(30)
        stream.close()
        results[0] = _answer(chunks)

    def fast():
        chunks = []
        for chunk in runner.stream(prompts[1], batched=True, **options):
            chunks.append(chunk)
            if len(chunks) == 33:
                ahead.set()
        results[1] = _answer(chunks)

    _queued_then_run(runner, [slow, fast])
    assert max(rows) == 2
    _assert_same_answers([results[1]], [want[1]])
    _assert_same_answers([results[0]], [_prefix(want[0], 3)])
    turn = prompts[0] + results[0][0] + _tokens(22, 10)
    got = _answer(runner.stream(turn, batched=True, **OPTIONS))
    _assert_same_answers([got], [_alone(loaded, turn)])


@pytest.mark.parametrize("arch", ["gemma3_text", "lfm2"])
def test_a_reader_behind_past_a_block_boundary_then_a_restart(loaded_tiny, tmp_path, arch, rows):
    """The slow row crosses a disk-tier block boundary (12 tokens into its reply) in the batch
    after its reader's last token, then leaves: a window keeps those tokens, recurrent state
    goes back before the boundary. A new Runner on the same directory answers a prompt that
    diverges inside that reply as a fresh Runner does."""
    from mlxkv.runner.disk.chains import BLOCK_TOKENS

    loaded = loaded_tiny(arch)
    options = {"max_tokens": 40, "temperature": 0.0, "logprobs": 0}
    stored = _tokens(30, 2 * BLOCK_TOKENS - 12)
    reply = _alone(loaded, stored, **options)[0]
    config = {"max_context": 2048, "cache_entries": 8, "max_batch": 4, "cache_dir": tmp_path}
    before = Runner(loaded, **config)
    ahead = threading.Event()
    read: list = []

    def slow():
        stream = before.stream(stored, batched=True, **options)
        read.extend(next(stream).token for _ in range(5))
        assert ahead.wait(30)
        stream.close()

    def fast():
        for n, _ in enumerate(before.stream(_tokens(31, 20), batched=True, **options)):
            if n == 16:  # the slow row 12 to 17 tokens past its reader: past the boundary
                ahead.set()

    _queued_then_run(before, [slow, fast])
    assert max(rows) == 2 and read == reply[:5]
    before.close()
    short = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0}
    # diverging past the boundary first: a turn diverging before it supersedes the block
    for cut, window_reuse in ((20, 2 * BLOCK_TOKENS), (3, len(stored) - 1)):
        prompt = stored + reply[:cut] + _tokens(32 + cut, 30)
        after = list(Runner(loaded, **config).stream(prompt, **short))
        fresh = Runner(loaded, max_context=2048, speculative=None)
        _assert_same_answers([_answer(after)], [_answer(fresh.stream(prompt, **short))])
        # a window kept the tokens past its reader, and the boundary's snapshot; recurrent
        # state went back before the boundary, to the last token read (the entry's end)
        want = window_reuse if arch == "gemma3_text" else len(stored) + (5 if cut > 5 else -1)
        assert after[-1].completion.cached_tokens == want
