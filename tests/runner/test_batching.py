"""Batched streams (`Runner.stream(batched=True)`, the server's) against the same requests run
one at a time: the same greedy tokens and log-probabilities on every architecture (batched
where the cache batches, taking turns where it cannot, said in the log), a stream that leaves
mid-batch, seeded sampling, and the cache budget held with a full batch. Every entry is checked
after every request by `tests/invariants.py`."""

from __future__ import annotations

import logging
import threading

import pytest

from mlxkv import Runner
from mlxkv.decoding.picker import TokenPicker
from mlxkv.errors import RunnerBusyError
from mlxkv.runner import request_run
from mlxkv.runner.prefill import group as prefill_group
from mlxkv.testing.factory import ARCHITECTURES
from tests.factories import InStep, joined, recorded, wait_until
from tests.tolerances import LOGPROB_ABS, logprob_rel

PROMPTS = [
    "The first request, about caches.",
    "Another one, somewhat longer than the first request was, about memory.",
    "Third.",
    "The fourth request of this test asks about batches and their rows.",
]
# factory models whose cache layers all batch: float K/V, sliding windows (gemma3_text, spark2_5:
# windows of 8 tokens, wrapping in these replies), recurrent state (lfm2, mamba)
BATCHING = ARCHITECTURES
# float K/V and windows (`can_prefill_together`), state that the probe at load finds exact;
# mamba's state reads the padding: prefilled alone
PREFILLED_TOGETHER = ("llama", "qwen3", "gemma3_text", "spark2_5", "lfm2")


def _tokens_and_logprobs(chunks):
    chunks = list(chunks)
    tokens = [c.token for c in chunks if c.token is not None]
    return tokens, [c.logprob.logprob for c in chunks if c.logprob is not None]


def _together(runner, prompts, **options):
    """(tokens, logprobs) of each prompt's batched stream, read as `_in_step` reads them."""
    return [_tokens_and_logprobs(chunks) for chunks in _in_step(runner, prompts, **options)]


def _in_step(runner, requests, *, each: list[dict] | None = None, **options) -> list[list]:
    """The chunks of each request's batched stream (with `options`, and its own of `each`
    over them), on a thread of its own, all queued before any runs (`_queued_then_run`) and
    read in step over their first two chunks (`InStep`): every stream that can batch
    decodes in one step with all the others that can, whatever the threads' timing."""
    step, got = InStep(len(requests)), [None] * len(requests)
    each = each or [{}] * len(requests)

    def read(i):
        stream = runner.stream(requests[i], batched=True, **{**options, **each[i]})
        got[i] = list(step.read(i, stream))

    _queued_then_run(runner, [lambda i=i: read(i) for i in range(len(requests))])
    return got


def _queued_then_run(runner, targets) -> None:
    """Each target (reading one batched stream) on a thread of its own, the engine held until
    every stream's first job is queued on it; returns when all have ended. A place taken in
    the batch is not enough: under load a thread can wait between its place and its first
    job while the others prefill and decode without it. The engine takes the holding job
    first, so that no first job goes ahead of it."""
    holding, gate = threading.Event(), threading.Event()
    runner._engine._submit(lambda: (holding.set(), gate.wait(30)))
    assert holding.wait(30), "the engine never took the holding job"
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(runner._engine._urgent) == len(targets), what="every first job queued")
    gate.set()
    joined(*threads)


def _assert_same_answers(got, want, kv_bits=None):
    """`kv_bits`: both sides' K/V quantized to it (a looser bound: `logprob_rel`)."""
    rel = logprob_rel(kv_bits)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ABS, rel=rel)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_streams_answer_as_one_at_a_time(loaded_tiny, arch, rows, caplog, monkeypatch):
    loaded = loaded_tiny(arch)
    options = {"max_tokens": 24, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [_tokens_and_logprobs(alone.stream(p, **options)) for p in PROMPTS]
    with caplog.at_level(logging.INFO, logger="mlxkv.runner.assembly"):
        runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    passes = recorded(monkeypatch, prefill_group, "prefill_together", lambda *a, **_: len(a[1]))
    got = _together(runner, PROMPTS, **options)
    _assert_same_answers(got, want)
    assert max(rows) == len(PROMPTS), "the streams never decoded all together"
    prefilled_alone = "prompts are prefilled alone" in caplog.text
    assert prefilled_alone == (arch not in PREFILLED_TOGETHER)
    assert bool(passes) == (arch in PREFILLED_TOGETHER), passes


def test_a_stream_that_leaves_mid_batch_leaves_the_others_exact(loaded_tiny, rows):
    loaded = loaded_tiny("llama")
    options = {"max_tokens": 32, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [_tokens_and_logprobs(alone.stream(p, **options)) for p in PROMPTS[:3]]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    left = threading.Event()
    results: list = [None] * 3
    step = InStep(3)  # all three decode in the batch before the leaver's third chunk

    def leaver():
        stream = step.read(0, runner.stream(PROMPTS[0], batched=True, **options))
        for n, _ in enumerate(stream, 1):
            if n == 3:
                stream.close()  # a client that went away
                left.set()
                return

    def stayer(i):
        chunks = step.read(i, runner.stream(PROMPTS[i], batched=True, **options))
        results[i] = _tokens_and_logprobs(chunks)

    _queued_then_run(runner, [leaver, lambda: stayer(1), lambda: stayer(2)])
    assert left.is_set() and max(rows) == 3
    _assert_same_answers(results[1:], want[1:])
    assert runner._dispatch._slots.taken == 0 and runner._dispatch._batching.batch.num_rows == 0


def test_a_seeded_stream_among_batched_ones_draws_as_alone(loaded_tiny, rows):
    """It decodes alone (taking turns with the batch), on its own random key."""
    loaded = loaded_tiny("llama")
    seeded = {"max_tokens": 16, "temperature": 1.0, "seed": 7}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [c.token for c in alone.stream(PROMPTS[0], **seeded) if c.token is not None]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    results: list = [None] * 3
    step = InStep(3)  # the two others decode in the batch together before either's third

    def run(i):
        options = seeded if i == 0 else {"max_tokens": 16, "temperature": 1.0}
        stream = step.read(i, runner.stream(PROMPTS[i], batched=True, **options))
        results[i] = [c.token for c in stream if c.token is not None]

    _queued_then_run(runner, [lambda i=i: run(i) for i in range(3)])
    assert results[0] == want
    assert max(rows) == 2  # the two others, batched


def test_the_budget_holds_after_a_full_batch(loaded_tiny):
    loaded = loaded_tiny("llama")
    budget = 96 * 1024
    runner = Runner(loaded, max_context=512, cache_entries=8, cache_bytes=budget, max_batch=4)
    _together(runner, PROMPTS, max_tokens=40, temperature=0.0)
    assert runner._dispatch._batching.batch.nbytes == 0
    assert runner._pool.nbytes <= budget


def test_more_streams_than_places_wait_and_a_cancelled_waiter_gives_up(loaded_tiny):
    runner = Runner(loaded_tiny("llama"), max_context=512, cache_entries=8, max_batch=1)
    gate = threading.Event()
    runner._engine._submit(lambda: gate.wait(30))
    first = runner.stream(PROMPTS[0], batched=True, max_tokens=4)
    holder = threading.Thread(target=lambda: list(first))
    holder.start()
    wait_until(lambda: runner._dispatch._slots.taken == 1, what="the first stream in its place")
    cancel = threading.Event()
    cancel.set()
    waiting = list(runner.stream(PROMPTS[1], batched=True, max_tokens=4, cancel=cancel))
    assert waiting[-1].completion.finish_reason == "cancelled"
    gate.set()
    joined(holder)
    assert runner._dispatch._slots.taken == 0


def test_a_second_stream_on_a_thread_still_reading_one_is_refused_not_hung(loaded_tiny):
    """With every place taken by this thread's own stream, waiting would never end."""
    runner = Runner(loaded_tiny("llama"), max_context=512, max_batch=1)
    first = runner.stream(PROMPTS[0], batched=True, max_tokens=8)
    next(first)
    with pytest.raises(RunnerBusyError):
        next(runner.stream(PROMPTS[1], batched=True, max_tokens=8))
    first.close()
    assert runner._dispatch._slots.taken == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_a_speculative_stream_joins_the_batch_when_another_comes(loaded_tiny, arch, rows):
    """Alone, a stream decodes speculatively; when a second stream takes a place it goes on
    in the batch with it (one forward for both), with the tokens it would have had alone."""
    loaded = loaded_tiny(arch)
    options = {"max_tokens": 40, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [_tokens_and_logprobs(alone.stream(p, **options)) for p in PROMPTS[:2]]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    got = _joined_mid_reply(runner, options, PROMPTS[1], options)
    _assert_same_answers(list(got), want)
    assert max(rows) == 2, "the speculative stream never joined the batch"


def _paused_mid_batch(runner, prompts, options, during, cache_keys=None):
    """Each prompt's batched stream on its own thread (with its key of `cache_keys`, if
    given); once every stream has read 4 chunks (all of them decoding in the batch: read in
    step over the first two, `InStep`, even those that began speculating alone), `during()`
    runs; then the streams finish."""
    results: list = [None] * len(prompts)
    halfway = [threading.Event() for _ in prompts]
    go = threading.Event()
    keys = cache_keys or [None] * len(prompts)
    step = InStep(len(prompts))

    def run(i):
        chunks = []
        stream = runner.stream(prompts[i], batched=True, cache_key=keys[i], **options)
        for chunk in step.read(i, stream):
            chunks.append(chunk)
            if len(chunks) == 4:
                halfway[i].set()
                go.wait(30)
        results[i] = _tokens_and_logprobs(chunks)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for event in halfway:
        assert event.wait(30)
    during()
    go.set()
    joined(*threads)
    return results


def test_reset_mid_batch_lets_the_streams_finish_then_drops_their_entries(loaded_tiny, rows):
    loaded = loaded_tiny("llama")
    options = {"max_tokens": 16, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [_tokens_and_logprobs(alone.stream(p, **options)) for p in PROMPTS[:2]]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4, speculative=None)
    got = _paused_mid_batch(runner, PROMPTS[:2], options, runner.reset)
    _assert_same_answers(got, want)
    assert max(rows) == 2
    assert runner._pool.entries == [] and runner.cache_info().entries == ()


def test_dropping_a_key_mid_batch_frees_its_entry_when_its_stream_ends_and_no_other(
    loaded_tiny, rows
):
    loaded = loaded_tiny("llama")
    options = {"max_tokens": 16, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [_tokens_and_logprobs(alone.stream(p, **options)) for p in PROMPTS[:2]]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4, speculative=None)
    dropped = []

    def drop() -> None:
        dropped.append(runner.drop_cache_entries("dropped"))

    got = _paused_mid_batch(runner, PROMPTS[:2], options, drop, ["dropped", "kept"])
    _assert_same_answers(got, want)
    assert max(rows) == 2 and dropped == [1]
    assert [entry.label for entry in runner.cache_info().entries] == ["kept"]
    assert runner.cached_prefix_tokens(alone.encode(PROMPTS[0])) < len(alone.encode(PROMPTS[0]))


def test_close_mid_batch_saves_what_each_entry_held_and_the_streams_finish(
    loaded_tiny, rows, tmp_path
):
    loaded = loaded_tiny("llama")
    options = {"max_tokens": 16, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [_tokens_and_logprobs(alone.stream(p, **options)) for p in PROMPTS[:2]]
    config = {"max_context": 512, "cache_entries": 8, "max_batch": 4, "cache_dir": tmp_path}
    runner = Runner(loaded, **config)
    prompts = [runner.encode(p) for p in PROMPTS[:2]]
    stored: list[int] = []

    def close_then_look():
        """What the close wrote, seen by a Runner started once it returned (the streams
        paused): each entry as it joined the batch, its prompt."""
        runner.close()
        stored.extend(Runner(loaded, **config).stored_prefix_tokens(p) for p in prompts)

    got = _paused_mid_batch(runner, PROMPTS[:2], options, close_then_look)
    _assert_same_answers(got, want)
    assert max(rows) == 2
    assert stored == [len(p) for p in prompts]
    # the streams' ends wrote their entries behind (superseding the close's files): a restart
    # comes after they landed, as a process's exit waits for them, not beside them
    runner.close()
    restarted = Runner(loaded, **config)
    again = list(restarted.stream(PROMPTS[0], **options))
    _assert_same_answers([_tokens_and_logprobs(again)], want[:1])
    assert again[-1].completion.cached_tokens > 0  # from the disk tier


def test_the_next_turn_started_at_the_last_chunk_finds_the_entry_released(loaded_tiny):
    """A client (the server) may send its next turn as soon as it has a reply's last chunk,
    before it asks the stream for its end; that turn reuses what it would after the end."""
    options = {"max_tokens": 16, "temperature": 0.0, "speculative": None}
    chat = [{"role": "user", "content": "Tell me about caches and their entries, please."}]

    def second_turn(early: bool):
        runner = Runner(loaded_tiny("llama"), max_context=1024, cache_entries=8, max_batch=4)
        first = runner.stream(chat, batched=True, **options)
        last = next(chunk for chunk in first if chunk.completion is not None)
        if not early:
            first.close()
        turn = [*chat, {"role": "assistant", "content": last.completion.text}]
        turn.append({"role": "user", "content": "And again?"})
        reply = {}
        second = threading.Thread(
            target=lambda: reply.setdefault("c", runner.generate(turn, batched=True, **options))
        )
        second.start()
        joined(second)
        first.close()
        return reply["c"].cached_tokens, len(runner._pool.entries)

    after_the_end = second_turn(early=False)
    assert after_the_end[0] > 0
    assert second_turn(early=True) == after_the_end


def _joined_mid_reply(runner, first_options, second_prompt, second_options):
    """A stream read for 3 chunks alone; a second one started and read for one chunk; the
    first read for 3 more (beside the second now), the second to its end (its row joins where
    the first decodes), then the first to its end; the first's tokens (its alone answer
    compared by the caller) and the second's. Each reader waits on the other's events, never
    on how threads happen to be scheduled."""
    first = runner.stream(PROMPTS[0], batched=True, **first_options)
    head = [next(first) for _ in range(3)]
    assert runner._dispatch._batching.batch.num_rows == 0  # decoding alone, speculatively
    started, resumed = threading.Event(), threading.Event()
    results = []

    def read_second():
        chunks = []
        for chunk in runner.stream(second_prompt, batched=True, **second_options):
            chunks.append(chunk)
            if len(chunks) == 1:
                started.set()
                resumed.wait(30)
        results.append(_tokens_and_logprobs(chunks))

    second = threading.Thread(target=read_second)
    second.start()
    assert started.wait(30)
    head += [next(first) for _ in range(3)]
    resumed.set()
    joined(second)
    return _tokens_and_logprobs([*head, *first]), results[0]


def test_a_speculative_stream_stays_alone_beside_one_that_cannot_batch(loaded_tiny, rows):
    """A seeded stream never joins the batch: the other keeps speculating."""
    loaded = loaded_tiny("llama")
    options = {"max_tokens": 40, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = _tokens_and_logprobs(alone.stream(PROMPTS[0], **options))
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    seeded = {"max_tokens": 8, "temperature": 1.0, "seed": 3}
    got, _ = _joined_mid_reply(runner, options, PROMPTS[1], seeded)
    _assert_same_answers([got], [want])
    assert not rows, "it went into a batch that nobody else could join"


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_a_speculative_stream_goes_back_alone_when_the_others_are_done(loaded_tiny, arch, rows):
    loaded = loaded_tiny(arch)
    options = {"max_tokens": 60, "temperature": 0.0, "logprobs": 0}
    short = {"max_tokens": 4, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [
        _tokens_and_logprobs(alone.stream(PROMPTS[0], **options)),
        _tokens_and_logprobs(alone.stream(PROMPTS[1], **short)),
    ]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    got = _joined_mid_reply(runner, options, PROMPTS[1], short)
    _assert_same_answers(list(got), want)
    assert max(rows) == 2
    assert len(rows) < 10, f"{len(rows)} batched steps: it stayed in the batch alone"


def test_a_request_failing_as_its_decoding_starts_is_not_counted_as_decoding(
    loaded_tiny, monkeypatch
):
    """Else every later stream would think another one decodes beside it."""
    runner = Runner(loaded_tiny("llama"), max_context=512, max_batch=4)

    def failing(*args, **kwargs):
        raise ValueError("no decoder")

    monkeypatch.setattr(request_run, "_decode", failing)
    with pytest.raises(ValueError, match="no decoder"):
        list(runner.stream(PROMPTS[0], batched=True, max_tokens=4))
    assert runner._dispatch._batching.streams == 0


@pytest.mark.parametrize("arch", PREFILLED_TOGETHER)
def test_streams_arriving_together_are_prefilled_together_and_answer_as_alone(
    loaded_tiny, arch, monkeypatch
):
    """Four streams whose first jobs are all queued before any runs: the three sharing no
    prefix are prefilled in one batched pass; the fourth (its first token is the first one's)
    waits for that token to be fed, copies it and feeds the rest itself. Every answer is
    its alone one."""
    loaded = loaded_tiny(arch)
    options = {"max_tokens": 12, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [_tokens_and_logprobs(alone.stream(p, **options)) for p in PROMPTS]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    passes = recorded(
        monkeypatch, prefill_group, "prefill_together",
        lambda _model, caches, _prompts, **_: [cache.num_tokens for cache in caches],
    )  # fmt: skip
    results = _first_jobs_queued_then_run(runner, PROMPTS, [options] * len(PROMPTS))
    assert passes == [[0, 0, 0]]
    _assert_same_answers(results, want)


def _first_jobs_queued_then_run(runner, prompts, options) -> list:
    """Each prompt's batched stream on a thread of its own, their first jobs all queued on
    the engine (held meanwhile) before any runs: (tokens, logprobs) per prompt."""
    results: list = [None] * len(prompts)

    def run(i):
        chunks = runner.stream(prompts[i], batched=True, **options[i])
        results[i] = _tokens_and_logprobs(chunks)

    _queued_then_run(runner, [lambda i=i: run(i) for i in range(len(prompts))])
    return results


@pytest.mark.parametrize("kind", ["seeded", "scored"])
def test_a_seeded_or_scored_stream_is_not_prefilled_with_others(loaded_tiny, monkeypatch, kind):
    """A seeded one's first token is drawn from logits of its prompt fed alone, as when it
    runs alone (batched kernels round otherwise); a scored one (`prompt_logprobs`) reads every
    position's logits, which a batched pass does not compute: the two others are prefilled
    together without it."""
    loaded = loaded_tiny("llama")
    prompts = ["Alpha one two.", "Bravo three four.", "Zulu five six seven eight."]
    greedy = {"max_tokens": 8, "temperature": 0.0, "logprobs": 0}
    seeded = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "logprobs": 0}
    options = [greedy, greedy, seeded if kind == "seeded" else {**greedy, "prompt_logprobs": 0}]
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [
        _tokens_and_logprobs(alone.stream(p, **o)) for p, o in zip(prompts, options, strict=True)
    ]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    passes = recorded(
        monkeypatch, prefill_group, "prefill_together",
        lambda _model, _caches, fed, **_: sorted(len(tokens) for tokens in fed),
    )  # fmt: skip
    results = _first_jobs_queued_then_run(runner, prompts, options)
    lengths = [len(runner.encode(p)) for p in prompts]
    assert passes == [sorted(lengths[:2])]
    if kind == "seeded":
        assert results[2] == want[2]  # its draws, exactly
    _assert_same_answers(results, want)


_SHARED_TOKENS = 100


def _sharing_a_prefix(loaded):
    """Three token prompts sharing their first 100 tokens, greedy options with logprobs, each
    prompt's alone answer, and a Runner that batches and feeds 16 tokens per chunk."""
    shared = [(7 * i) % 200 + 5 for i in range(_SHARED_TOKENS)]
    prompts = [shared + [300 + i, 310 + i, 320 + i] for i in range(3)]
    options = {"max_tokens": 8, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [_tokens_and_logprobs(alone.stream(p, **options)) for p in prompts]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4, prefill_step_size=16)
    return prompts, options, want, runner


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_streams_arriving_together_feed_their_shared_prefix_once(loaded_tiny, arch):
    """Three prompts sharing 100 tokens (an agent's system prompt), started at once: the
    first feeds them, the others wait for it and copy them (cached 100; layers that cannot
    trim back copy a checkpoint), and every answer is still its alone one."""
    prompts, options, want, runner = _sharing_a_prefix(loaded_tiny(arch))
    results: list = [None] * 3

    def run(i):
        chunks = list(runner.stream(prompts[i], batched=True, **options))
        results[i] = (_tokens_and_logprobs(chunks), chunks[-1].completion.cached_tokens)

    _queued_then_run(runner, [lambda i=i: run(i) for i in range(3)])
    _assert_same_answers([answer for answer, _ in results], want)
    assert sorted(cached for _, cached in results) == [0, _SHARED_TOKENS, _SHARED_TOKENS]


def test_streams_waiting_for_a_shared_prefix_go_on_when_its_feeder_is_cancelled(loaded_tiny):
    """The stream feeding the shared 100 tokens, cancelled halfway through: the others stop
    waiting, reuse what it fed and feed the rest themselves, with their alone answers."""
    prompts, options, want, runner = _sharing_a_prefix(loaded_tiny("llama"))
    cancels = [threading.Event() for _ in prompts]
    first_past_48 = threading.Lock()  # taken by the feeder, the first to feed 48 tokens
    results: list = [None] * 3

    def run(i):
        def progress(done, _total):
            if done >= 48 and first_past_48.acquire(blocking=False):
                cancels[i].set()

        stream = runner.stream(
            prompts[i], batched=True, cancel=cancels[i], progress=progress, **options
        )
        chunks = list(stream)
        results[i] = (_tokens_and_logprobs(chunks), chunks[-1].completion)

    _queued_then_run(runner, [lambda i=i: run(i) for i in range(3)])
    (feeder,) = [i for i in range(3) if cancels[i].is_set()]
    assert results[feeder][1].finish_reason == "cancelled"
    others = [i for i in range(3) if i != feeder]
    _assert_same_answers([results[i][0] for i in others], [want[i] for i in others])
    cached = sorted(results[i][1].cached_tokens for i in others)
    assert 48 <= cached[0] < _SHARED_TOKENS and cached[1] == _SHARED_TOKENS


def test_greedy_rows_reporting_no_logprobs_pick_together_and_answer_as_alone(
    loaded_tiny, rows, monkeypatch
):
    """Greedy rows that report no log-probabilities take the argmax of the batch's logits in
    one op (no normalizing, no per-row pick): their tokens are those of the same request
    alone with log-probabilities (normalized, row by row), beside a row that reports them."""
    loaded = loaded_tiny("llama")
    options = {"max_tokens": 24, "temperature": 0.0}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [_tokens_and_logprobs(alone.stream(p, logprobs=0, **options)) for p in PROMPTS[:3]]
    # unspeculated: a row decoding alone for a while would pick its own tokens
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4, speculative=None)
    bare_picks = []
    call = TokenPicker.__call__

    def counting(self, logits):
        if self.bare_argmax:
            bare_picks.append(logits.shape)
        return call(self, logits)

    monkeypatch.setattr(TokenPicker, "__call__", counting)
    each = [{}, {}, {"logprobs": 0}]
    chunks = _in_step(runner, PROMPTS[:3], each=each, **options)
    results = [_tokens_and_logprobs(c) for c in chunks]
    assert max(rows) == 3
    assert [tokens for tokens, _ in results] == [tokens for tokens, _ in want]
    _assert_same_answers(results[2:], want[2:])
    assert len(bare_picks) == 2  # each bare row's first token, from its prompt's logits
