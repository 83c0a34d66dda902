"""Review probes of batched windows and recurrent state (merge fd1e4a3): a window longer than
mlx-lm's growth step of `BatchRotatingKVCache` (rows joining while its buffer grows, then
wraps), and a slow reader falling far behind on window and recurrent models. Each row against
the same sequence decoded alone."""

from __future__ import annotations

import pytest

from mlxkv.decoding.batch import DecodeBatch, batched_tokens
from mlxkv.models.loading import load_model
from mlxkv.testing.factory import build_model
from tests.decoding.test_batch import _alone, _assert_holds_what_it_fed, _start
from tests.tolerances import LOGPROB_ABS


def _prompt(seed: int, count: int) -> list[int]:
    return [(seed * 131 + 7 * i) % 480 + 10 for i in range(count)]


@pytest.fixture(scope="module")
def long_window(tmp_path_factory):
    """Gemma 3 with a window of 300 tokens: longer than mlx-lm's batched window grows at a
    time (256), as real windows are (512 to 4096)."""
    path = tmp_path_factory.mktemp("models") / "gemma3_w300"
    overrides = {"sliding_window": 300, "sliding_window_pattern": 2}
    return load_model(build_model("gemma3_text", path, config_overrides=overrides)).model


def test_rows_join_while_a_long_window_grows_and_wraps(long_window):
    model = long_window
    prompts = [_prompt(1, 20), _prompt(2, 285), _prompt(3, 420), _prompt(4, 150)]
    max_tokens = [40, 30, 30, 30]
    alone = [_alone(model, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    batch = DecodeBatch(model, max_rows=4)
    rows = {}

    def start(i):
        cache, logits, pick = _start(model, prompts[i])
        rows[i] = (cache, pick, batched_tokens(batch, cache, logits, pick, max_tokens[i]), [])

    def read(i, n=1):
        for _ in range(n):
            rows[i][3].append(next(rows[i][2]))

    start(0)
    read(0, 4)  # alone: the buffer grows from 20 slots
    start(1)  # 285 tokens, not yet wrapped: wraps in the batch
    read(0, 3)
    read(1, 3)
    start(2)  # wrapped before it joins
    read(2, 2)
    read(0, 2)
    start(3)
    for i in (0, 1, 2, 3):
        rows[i][3].extend(rows[i][2])
    for i, (cache, pick, _, streamed) in rows.items():
        want_tokens, want_logprobs = alone[i]
        assert streamed == want_tokens, f"row {i}"
        logprobs = [pick.pop_logprob().logprob for _ in streamed]
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ABS), f"row {i}"
        _assert_holds_what_it_fed(model, cache, prompts[i], streamed, want_tokens)


@pytest.mark.parametrize("arch", ["lfm2", "mamba"])
def test_the_recurrent_state_a_lagging_row_keeps_is_counted_in_the_batch_bytes(loaded_tiny, arch):
    """A reader 30 steps behind (another reads on meanwhile): its row keeps the batch's
    recurrent arrays of every step it has not read (`state_marks`, to go back to), alive
    beside the batch's own. The pool's budget reads the batch's bytes (`pool.working`), so
    they should be in `DecodeBatch.nbytes`."""
    model = loaded_tiny(arch).model
    prompts = [_prompt(5, 30), _prompt(6, 12)]
    batch = DecodeBatch(model, max_rows=2)
    started = [_start(model, p) for p in prompts]
    streams = [batched_tokens(batch, c, lg, pk, 40) for c, lg, pk in started]
    next(streams[0]), next(streams[0])
    for _ in range(30):
        next(streams[1])
    marks = {id(m): m for row in batch._rows for _, _, m in row.out if m is not None}
    arrays = {id(a): a for m in marks.values() for a in _leaves(m)}
    held = sum(a.nbytes for a in arrays.values())
    print(f"{len(marks)} steps' marks, {held} bytes; the batch's nbytes {batch.nbytes}")
    try:
        assert batch.nbytes >= held, f"{held} bytes of marks, batch.nbytes {batch.nbytes}"
    finally:
        for stream in streams:
            stream.close()


def _leaves(marks):
    for mark in marks:
        if isinstance(mark, list):
            yield from _leaves(mark)
        elif mark is not None:
            yield mark


@pytest.mark.parametrize("arch", ["lfm2", "mamba", "gemma3_text"])
def test_a_row_done_in_the_batch_before_its_reader_stops_goes_back_exact(loaded_tiny, arch):
    """The slow row produces all its tokens (it leaves the batch at its last step) while its
    reader has read 2; the reader then stops: recurrent state goes back to the step of its
    last read token from the marks of a row that is no longer in the batch."""
    model = loaded_tiny(arch).model
    prompts = [_prompt(7, 18), _prompt(8, 9)]
    alone = _alone(model, prompts[0], 10)
    batch = DecodeBatch(model, max_rows=2)
    started = [_start(model, p) for p in prompts]
    pairs = zip(started, (10, 30), strict=True)
    streams = [batched_tokens(batch, c, lg, pk, n) for (c, lg, pk), n in pairs]
    slow = [next(streams[0]), next(streams[0])]
    for _ in range(20):
        next(streams[1])
    assert batch.num_rows == 1  # the slow row is done, its tokens queued
    streams[0].close()
    streams[1].close()
    assert slow == alone[0][:2]
    _assert_holds_what_it_fed(model, started[0][0], prompts[0], slow, alone[0])
