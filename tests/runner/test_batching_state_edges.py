"""Review probes of batched windows and recurrent state (merge fd1e4a3) through a Runner, each
request checked by tests/invariants.py after it ends (`tests/conftest.py`)."""

from __future__ import annotations

import threading

import pytest

from mlxkv import Runner
from tests.factories import InStep, joined
from tests.runner.test_batching import _assert_same_answers, _in_step, _queued_then_run
from tests.runner.test_batching_layer_kinds import OPTIONS, _answer, _prefix, _tokens


def _alone(loaded, prompt, **options):
    """The request alone on a fresh Runner (a window long enough for the disk tier's blocks)."""
    fresh = Runner(loaded, max_context=2048, speculative=None)
    return _answer(fresh.stream(prompt, **{**OPTIONS, **options}))


# Not a full sliding window (gemma3_text): it goes back one token at most, so a reader this
# far behind leaves its entry holding the tokens decoded ahead (exact, but past the bound;
# docs/batching.md, "Which cache layers batch").
@pytest.mark.parametrize("arch", ["lfm2", "mamba"])
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
    step = InStep(2)  # both rows in the batch before the slow one falls behind

    def slow():
        stream = step.read(0, runner.stream(prompts[0], batched=True, **options))
        chunks = [next(stream) for _ in range(3)]
        assert ahead.wait(30)
        stream.close()
        results[0] = _answer(chunks)

    def fast():
        chunks = []
        for chunk in step.read(1, runner.stream(prompts[1], batched=True, **options)):
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
    ahead, closed = threading.Event(), threading.Event()
    read: list = []
    step = InStep(2)  # both rows in the batch before the slow one falls behind

    def slow():
        stream = step.read(0, before.stream(stored, batched=True, **options))
        read.extend(next(stream).token for _ in range(5))
        assert ahead.wait(30)
        stream.close()
        closed.set()

    def fast():
        stream = step.read(1, before.stream(_tokens(31, 20), batched=True, **options))
        for n, _ in enumerate(stream):
            if n == 16:  # the slow row 12 to 17 tokens past its reader: past the boundary
                ahead.set()
                # until its close: reading on meanwhile, a loaded machine fed it 34 (17 allowed)
                assert closed.wait(30)

    _queued_then_run(before, [slow, fast])
    assert max(rows) == 2 and read == reply[:5]
    before.close()
    short = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0}
    # diverging past the boundary first: a turn diverging before it supersedes the block.
    # Each restart closes (its entry's writes landed) before the next one starts: a block
    # the previous one supersedes between the next one's look-up and load restores less
    for cut, window_reuse in ((20, 2 * BLOCK_TOKENS), (3, len(stored) - 1)):
        prompt = stored + reply[:cut] + _tokens(32 + cut, 30)
        with Runner(loaded, **config) as restarted:
            after = list(restarted.stream(prompt, **short))
        fresh = Runner(loaded, max_context=2048, speculative=None)
        _assert_same_answers([_answer(after)], [_answer(fresh.stream(prompt, **short))])
        # a window kept the tokens past its reader (its end past the boundary); recurrent
        # state went back before the boundary, to the last token read (the entry's end)
        cached = after[-1].completion.cached_tokens
        if arch == "gemma3_text":
            assert cached >= window_reuse
        else:
            assert cached == len(stored) + (5 if cut > 5 else -1)


@pytest.mark.parametrize("arch", ["gemma3_text", "spark2_5", "lfm2", "mamba"])
def test_rows_gone_back_to_a_checkpoint_join_the_batch_as_alone(loaded_tiny, arch, rows):
    """Turn 1 of two conversations in the batch; then, together, a regenerated reply of the
    first (its entry goes back to the checkpoint where the reply starts) and the second's next
    turn (going back inside its reply), then an edit of the first's prompt: each as alone."""
    loaded = loaded_tiny(arch)
    options = {**OPTIONS, "max_tokens": 20}
    first, second = _tokens(40, 33), _tokens(41, 14)
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)

    def together(prompts):
        return [_answer(chunks) for chunks in _in_step(runner, prompts, **options)]

    one = together([first, second])
    rounds = [
        [first, second + one[1][0][:7] + _tokens(42, 6)],
        [first[:20] + _tokens(43, 5), second + one[1][0][:3]],
    ]
    for prompts in rounds:
        got = together(prompts)
        _assert_same_answers(got, [_alone(loaded, p, **options) for p in prompts])
    assert max(rows) == 2


@pytest.mark.parametrize("arch", ["gemma3_text", "lfm2"])
def test_a_failed_batched_step_ends_its_rows_and_the_next_requests_answer_as_alone(
    loaded_tiny, arch, monkeypatch
):
    """A step whose pick raises after the forward pass (as a grammar refusing a token does):
    every stream in the batch ends with the error, nothing stays in use, and each
    conversation's next request (reusing what its entry kept) answers as alone."""
    from mlxkv.decoding import batch as batch_module

    loaded = loaded_tiny(arch)
    prompts = [_tokens(50, 30), _tokens(51, 12), _tokens(52, 21)]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    pick, calls = batch_module._pick, []

    def failing(rows, logits):  # the first step with all three rows fails, whenever their
        calls.append(len(rows))  # prefills (grouped by arrival) let them join
        if len(rows) == 3 and calls.count(3) == 1:
            raise RuntimeError("a grammar refused the token")
        return pick(rows, logits)

    monkeypatch.setattr(batch_module, "_pick", failing)
    errors: list = [None] * len(prompts)

    def run(i):
        try:
            list(runner.stream(prompts[i], batched=True, **OPTIONS))
        except RuntimeError as error:
            errors[i] = error

    _queued_then_run(runner, [lambda i=i: run(i) for i in range(len(prompts))])
    assert calls.count(3) == 1 and all(errors), (calls, errors)
    assert not runner._pool._in_use and runner._dispatch._batching.batch.num_rows == 0
    monkeypatch.setattr(batch_module, "_pick", pick)
    again = [prompts[0] + _tokens(53, 4), prompts[1], prompts[2][:15]]
    got: list = [None] * len(again)

    def run_again(i):
        got[i] = _answer(runner.stream(again[i], batched=True, **OPTIONS))

    _queued_then_run(runner, [lambda i=i: run_again(i) for i in range(len(again))])
    _assert_same_answers(got, [_alone(loaded, p) for p in again])


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_close_mid_batch_on_a_hybrid_then_a_restart_answers_as_alone(loaded_tiny, tmp_path, arch):
    """As test_batching's close mid-batch (llama there): the rows cross a block boundary in
    the batch after the close wrote their entries; a restart answers prompts diverging before
    and past that boundary as a fresh Runner."""
    from mlxkv.runner.disk.chains import BLOCK_TOKENS
    from tests.runner.test_batching import _paused_mid_batch

    loaded = loaded_tiny(arch)
    options = {"max_tokens": 16, "temperature": 0.0, "logprobs": 0}
    prompts = [_tokens(60, 2 * BLOCK_TOKENS - 8), _tokens(61, 2 * BLOCK_TOKENS - 6)]
    want = [_alone(loaded, p, **options) for p in prompts]
    config = {"max_context": 2048, "cache_entries": 8, "max_batch": 4, "cache_dir": tmp_path}
    runner = Runner(loaded, **config)
    got = _paused_mid_batch(runner, prompts, options, runner.close)
    _assert_same_answers(got, want)
    short = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0}
    for prompt in (prompts[0] + want[0][0][:12] + _tokens(62, 9), prompts[1][:300]):
        after = _answer(Runner(loaded, **config).stream(prompt, **short))
        _assert_same_answers([after], [_alone(loaded, prompt, **short)])


# Layers that trim only: a stream gone back to speculating has left the batch, so a full window
# or recurrent state cannot give back the queued tokens it was fed (docs/batching.md).
@pytest.mark.parametrize("arch", ["llama"])
def test_a_speculative_stream_left_behind_in_the_batch_then_closed(loaded_tiny, arch, rows):
    """A speculative stream joins the batch when another comes, falls behind while the other
    reads to its end, reads one more token (it leaves the batch with the tokens queued for
    it: `_alone_or_batched`) and closes: its entry may hold at most 17 tokens past what it
    streamed (tests/invariants.py), and the next turn answers as alone."""
    loaded = loaded_tiny(arch)
    options = {"max_tokens": 60, "temperature": 0.0, "logprobs": 0}
    prompts = [_tokens(70, 20), _tokens(71, 15)]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    first = runner.stream(prompts[0], batched=True, **options)
    read = [next(first).token for _ in range(3)]  # alone, speculating
    assert runner._dispatch._batching.batch.num_rows == 0
    b_started, a_joined, b_done = threading.Event(), threading.Event(), threading.Event()

    def second():
        stream = runner.stream(prompts[1], batched=True, max_tokens=30, temperature=0.0)
        next(stream), next(stream)
        b_started.set()
        assert a_joined.wait(30)
        list(stream)
        b_done.set()

    other = threading.Thread(target=second)
    other.start()
    assert b_started.wait(30)
    read.append(next(first).token)  # its last alone (the hand-over asked after it)
    read.append(next(first).token)  # in the batch with the other now
    in_batch = runner._dispatch._batching.batch.num_rows
    a_joined.set()
    assert b_done.wait(60)
    joined(other)
    read.append(next(first).token)  # the other is done: out of the batch, tokens queued
    first.close()
    assert in_batch == 2 and max(rows) == 2, (in_batch, rows)
    want = _alone(loaded, prompts[0], **options)[0]
    assert read == want[: len(read)]
    turn = prompts[0] + read + _tokens(72, 6)
    got = _answer(runner.stream(turn, batched=True, **OPTIONS))
    _assert_same_answers([got], [_alone(loaded, turn)])


def test_a_grammar_that_gives_up_mid_reply_ends_its_own_stream_only(loaded_tiny):
    """llguidance gives up on some grammars only once tokens come (a JSON schema of 3,000
    alternatives: "Current row has 3000 items; max is 2000"), raising in that row's pick after
    the forward pass; the other streams of the batch go on and answer as alone (one client's
    schema ended every client's reply in the batch)."""
    from mlxkv import GrammarError
    from mlxkv.decoding.grammar import json_schema_grammar

    loaded = loaded_tiny("llama")
    prompts = [_tokens(60, 20), _tokens(61, 12)]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    branches = [
        {"type": "object", "properties": {f"k{i}": {"type": "string"}}, "required": [f"k{i}"]}
        for i in range(3000)
    ]
    grammar = json_schema_grammar({"anyOf": branches})
    results: list = [None, None]
    errors: list = []

    def normal(i):
        results[i] = _answer(runner.stream(prompts[i], batched=True, **OPTIONS))

    def hostile():
        try:
            list(runner.stream(_tokens(62, 8), batched=True, grammar=grammar, **OPTIONS))
        except GrammarError as error:
            errors.append(error)

    _queued_then_run(runner, [lambda: normal(0), lambda: normal(1), hostile])
    assert len(errors) == 1 and "grammar" in str(errors[0]), errors
    _assert_same_answers(results, [_alone(loaded, p) for p in prompts])
    assert not runner._pool._in_use and runner._dispatch._batching.batch.num_rows == 0
