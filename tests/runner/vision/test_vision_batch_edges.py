"""Review probes of a vision model's batched decoding (merge e9dca60): each request against
itself run alone on a fresh Runner (greedy tokens, log-probabilities within the batched
kernels' rounding), with mixed rows the batch tests do not cover: a text-only request that
speculates alone and then joins image rows, grammars / stop strings / top logprobs / other
max_tokens in one batch, a prompt cut to the window, prefix hits ending after and inside an
image, seeded requests and `max_batch=1`. Every entry is checked after every request by
`tests/invariants.py`. Runners decode unspeculated but in the first test: a request with
images speculates while alone, so whether rows ever share a step would be left to thread
timing (seen with one row on a loaded machine)."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("mlx_vlm")

from mlxkv import Runner, json_schema_grammar  # noqa: E402
from mlxkv.cache.building import make_cache  # noqa: E402
from mlxkv.decoding import decoders  # noqa: E402
from mlxkv.testing.vision_factory import noise_images  # noqa: E402
from tests.factories import joined, recorded, wait_until  # noqa: E402
from tests.runner.conftest import record_batch_steps  # noqa: E402
from tests.runner.test_batching import _in_step, _queued_then_run  # noqa: E402
from tests.runner.vision.test_vision_batch import _batches, _user  # noqa: E402
from tests.tolerances import LOGPROB_ABS  # noqa: E402

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def images():
    shapes = [(56, 56, 3), (84, 112, 3), (112, 56, 3), (112, 112, 3)]
    return noise_images(7, shapes)


@pytest.fixture
def steps(monkeypatch):
    """(rows, shifts) of every batched step requests took (not the warm-up's)."""
    return record_batch_steps(
        monkeypatch,
        lambda batch: (batch.num_rows, None if batch._shifts is None else batch._shifts.tolist()),
    )


def _result(chunks):
    """(tokens, logprobs, top alternatives' ids, text, finish_reason) of a stream's chunks."""
    chunks = list(chunks)
    tokens = [c.token for c in chunks if c.token is not None]
    logprobs = [c.logprob.logprob for c in chunks if c.logprob is not None]
    tops = [[lp for _, lp in c.logprob.top] for c in chunks if c.logprob is not None]
    done = chunks[-1].completion
    return tokens, logprobs, tops, done.text, done.finish_reason


def _alone(loaded, messages, max_context: int = 1024, **options):
    runner = Runner(loaded, max_context=max_context, speculative=None)
    return _result(runner.stream(messages, logprobs=options.pop("logprobs", 0), **options))


def _assert_same(got, want) -> None:
    assert got is not None, "the stream did not finish"
    tokens, logprobs, tops, text, finish = got
    w_tokens, w_logprobs, w_tops, w_text, w_finish = want
    assert tokens == w_tokens
    assert text == w_text
    assert finish == w_finish
    assert logprobs == pytest.approx(w_logprobs, abs=LOGPROB_ABS)
    assert len(tops) == len(w_tops)
    for top, w_top in zip(tops, w_tops, strict=True):
        assert top == pytest.approx(w_top, abs=LOGPROB_ABS)


def _assert_most_rows(steps, loaded, rows: int) -> None:
    """The largest batched step had `rows` rows where the family batches, one at most where
    it does not (read in step, so a count, not a race)."""
    most = max((n for n, _ in steps), default=0)
    assert most == rows if _batches(loaded) else most <= 1, steps


def _speculating_then_joined(
    runner, first, others, *, first_options: dict, later_tokens: int, join_s: float = 120
) -> list:
    """`first` streamed speculating (n-gram) while alone; after its 6th chunk the two `others`
    are streamed, and it reads on once each has its first token (so that they share the
    batch): the `_result` of each, `first`'s first."""
    got: list = [None] * 3
    sixth_read = threading.Event()
    started = threading.Barrier(3)  # the first reader waits for the others' first token

    def read_first():
        stream = runner.stream(first, batched=True, speculative="ngram", **first_options, **GREEDY)
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 6:
                sixth_read.set()
                started.wait(60)
        got[0] = _result(chunks)

    def later(i):
        assert sixth_read.wait(60)
        options = {"max_tokens": later_tokens, "logprobs": 0, **GREEDY}
        stream = runner.stream(others[i], batched=True, **options)
        chunks = [next(stream)]
        started.wait(60)
        got[1 + i] = _result(chunks + list(stream))

    readers = (read_first, lambda: later(0), lambda: later(1))
    threads = [threading.Thread(target=reader) for reader in readers]
    for thread in threads:
        thread.start()
    joined(*threads, timeout_s=join_s)
    return got


def test_a_text_request_speculating_alone_then_joined_by_image_rows_stays_exact(
    loaded, images, steps, monkeypatch
):
    """A text-only request on a vision model speculates (n-gram) while alone; two image
    requests come, it joins their batch (shift 0 beside their shifts), and goes on alone
    when they are done."""
    text = [{"role": "user", "content": "Repeat: one two three one two three one two three"}]
    others = [[_user(images[3], "What is this?")], [_user(images[1], "And this one?")]]
    want_text = _alone(loaded, text, max_tokens=64, **GREEDY)
    want = [_alone(loaded, m, max_tokens=12, **GREEDY) for m in others]
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=4)
    speculated = recorded(monkeypatch, decoders, "speculative_tokens", lambda *a, **k: k["after"])
    # a row joined from speculation (`_alone_or_batched`): its position shift
    rejoined = recorded(monkeypatch, decoders, "joined_tokens", lambda *a, **k: k["position_shift"])
    got = _speculating_then_joined(
        runner, text, others, first_options={"max_tokens": 64, "logprobs": 0}, later_tokens=12
    )
    _assert_same(got[0], want_text)
    for g, w in zip(got[1:3], want, strict=True):
        _assert_same(g, w)
    if not _batches(loaded):
        assert not steps
        return
    assert any(rows >= 2 for rows, _ in steps), "no two rows decoded together"
    # alone first, then in the batch with no shift (whether it goes back to speculating
    # depends on when the image streams' readers take their last chunks)
    assert speculated[0] is None and rejoined[:1] == [0], (speculated, rejoined)
    if loaded.vision.family.uses_positions:  # M-RoPE: the text row unshifted beside them
        assert any(shifts and 0 in shifts and any(shifts) for _, shifts in steps), steps


def test_grammar_stop_and_top_logprobs_rows_beside_image_rows(loaded, images, steps):
    """One batch: an image row held to a JSON schema, a text row with a stop string and 3
    alternatives per token, an image row with other max_tokens."""
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["color", "count"],
    }
    grammar = json_schema_grammar(schema)
    requests = [
        ([_user(images[0], "Describe it as JSON.")], {"grammar": grammar, "max_tokens": 24}),
        (
            [{"role": "user", "content": "Count up: 1 2 3 4 5 6 7 8 9"}],
            {"logprobs": 3, "max_tokens": 20},
        ),
        ([_user(images[1], "What is this?", images[2], "and this?")], {"max_tokens": 7}),
    ]
    want = [_alone(loaded, m, **GREEDY, **dict(o)) for m, o in requests]
    # a stop string the text row's free answer reaches
    stop_text = want[1][3][3:8]
    if stop_text:
        requests[1][1]["stop"] = [stop_text]
        want[1] = _alone(loaded, requests[1][0], **GREEDY, **dict(requests[1][1]))
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=4, speculative=None)
    each = [{"logprobs": 0, **o} for _, o in requests]
    read = _in_step(runner, [m for m, _ in requests], each=each, **GREEDY)
    got = [_result(chunks) for chunks in read]
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    json.loads(got[0][3]) if got[0][4] == "stop" else None
    _assert_most_rows(steps, loaded, 3)


def _over_the_window(image, last: dict) -> list[dict]:
    """A chat whose second message (`image` and a long text) is dropped to fit the window
    `_cut_beside` sets, the third with it; the system prompt and `last` are kept."""
    long = "Describe the picture: the quick brown fox jumps over the lazy dog. " * 12
    return [
        {"role": "system", "content": "Be brief."},
        _user(image, long),
        {"role": "assistant", "content": "A fox."},
        last,
    ]


def _cut_beside(loaded, steps, cut: list[dict], other: list[dict]) -> None:
    """`cut` (`_over_the_window`) and `other` decode together on a Runner whose window holds
    twice what the cut keeps, each as alone on a Runner of that window, the cut one as its
    kept messages alone; two rows share a step where the family batches."""
    kept = cut[:1] + cut[3:]
    probe = Runner(loaded, max_context=4096)
    window = 2 * len(probe.encode(kept)) + 16 + 2
    assert len(probe.encode(cut)) > window
    want = [_alone(loaded, m, max_context=window, max_tokens=16, **GREEDY) for m in (cut, other)]
    assert want[0][0] == _alone(loaded, kept, max_context=window, max_tokens=16, **GREEDY)[0]
    runner = Runner(loaded, max_context=window, cache_entries=8, max_batch=4, speculative=None)
    options = {"max_tokens": 16, "logprobs": 0, **GREEDY}
    got = [_result(chunks) for chunks in _in_step(runner, [cut, other], **options)]
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert (max((rows for rows, _ in steps), default=0) >= 2) == _batches(loaded)


def test_a_prompt_cut_to_the_window_decodes_in_the_batch_at_its_kept_shift(loaded, images, steps):
    """The oldest image message is dropped to fit the window; the kept prompt (one image)
    decodes beside another image request, as it does alone on a Runner of that window."""
    cut = _over_the_window(images[1], _user(images[0], "And this?"))
    _cut_beside(loaded, steps, cut, [_user(images[2], "What is this?")])


def test_prefix_hits_ending_after_and_inside_an_image_decode_in_the_batch(loaded, images, steps):
    """The cache holds the image and a question (a prompt fed in full) and half an image (a
    prefill cancelled mid-image); requests reusing each decode together as each alone."""
    first = [_user(images[1], "What colors are in this picture? Tell me.")]
    second = [_user(images[1], "What shapes are in this picture? Tell me.")]
    partial = [_user(images[3], "Tell me about this one, in detail, please.")]
    want = [_alone(loaded, m, max_tokens=12, **GREEDY) for m in (second, partial)]
    runner = Runner(
        loaded,
        max_context=1024,
        cache_entries=8,
        max_batch=4,
        prefill_step_size=8,
        speculative=None,
    )
    runner.generate(first, max_tokens=4, **GREEDY)
    cancel = threading.Event()
    fed = []
    image_tokens = [i for i, t in enumerate(runner.encode(partial)) if t >= 1 << 31]

    def progress(done, total):
        fed.append(done)
        if done > image_tokens[0]:
            cancel.set()

    done = list(runner.stream(partial, max_tokens=4, cancel=cancel, progress=progress))
    assert done[-1].completion.finish_reason == "cancelled"
    assert image_tokens[0] < max(fed) < image_tokens[-1], "the cancel must cut the image"
    read = _in_step(runner, [second, partial], max_tokens=12, logprobs=0, **GREEDY)
    got = [_result(chunks) for chunks in read]
    cached = [chunks[-1].completion.cached_tokens for chunks in read]
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    if not _batches(loaded):
        assert not steps
        return
    assert max(rows for rows, _ in steps) == 2  # read in step: both rows in one step
    if make_cache(loaded.model).needs_checkpoints:  # sliding windows: reused at checkpoints only
        return
    assert cached[0] > max(i for i, t in enumerate(runner.encode(second)) if t >= 1 << 31)
    assert image_tokens[0] < cached[1] < image_tokens[-1], cached


def test_a_seeded_image_request_beside_batched_rows_draws_as_alone(loaded, images, steps):
    sampled = {"temperature": 0.9, "seed": 11}
    seeded = [_user(images[3], "What is this?")]
    others = [[_user(images[1], "And this?")], [{"role": "user", "content": "Say something."}]]
    # alone on a Runner set as the one below (a seeded request with images speculates too)
    alone = Runner(loaded, max_context=1024).stream(seeded, max_tokens=12, logprobs=0, **sampled)
    want_seeded = _result(alone)
    want = [_alone(loaded, m, max_tokens=12, **GREEDY) for m in others]
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=4, speculative=None)
    each = [sampled, GREEDY, GREEDY]
    read = _in_step(runner, [seeded, *others], each=each, max_tokens=12, logprobs=0)
    got = [_result(chunks) for chunks in read]
    assert got[0][0] == want_seeded[0]
    for g, w in zip(got[1:], want, strict=True):
        _assert_same(g, w)
    _assert_most_rows(steps, loaded, 2)  # a seeded row draws with its own key, alone


def test_max_batch_one_takes_turns_as_alone(loaded, images, steps):
    conversations = [
        [_user(images[0], "What is this?")],
        [_user(images[1], "And this?")],
        [{"role": "user", "content": "Say something."}],
    ]
    want = [_alone(loaded, m, max_tokens=10, **GREEDY) for m in conversations]
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=1)
    got: list = [None] * 3

    def run(i):
        stream = runner.stream(conversations[i], batched=True, max_tokens=10, logprobs=0, **GREEDY)
        got[i] = _result(stream)

    threads = [threading.Thread(target=lambda i=i: run(i)) for i in range(3)]
    for thread in threads:
        thread.start()
    joined(*threads, timeout_s=120)
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert all(rows == 1 for rows, _ in steps)


def test_a_row_cancelled_mid_batch_leaves_its_entry_as_fed(loaded, images, steps):
    """An image row cancelled mid-reply leaves the batch; the others go on as alone and the
    cancelled conversation's next request equals a fresh Runner's."""
    conversations = [
        [_user(images[1], "What is this?")],
        [_user(images[3], "And this?")],
        [{"role": "user", "content": "Say something long."}],
    ]
    want = [_alone(loaded, m, max_tokens=24, **GREEDY) for m in conversations]
    assert want[0][4] == "length"
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=4, speculative=None)
    cancel = threading.Event()
    got: list = [None] * 3

    def run(i):
        stream = runner.stream(
            conversations[i],
            batched=True,
            max_tokens=24,
            logprobs=0,
            cancel=cancel if i == 0 else None,
            **GREEDY,
        )
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if i == 0 and len(chunks) == 5:
                cancel.set()
        got[i] = _result(chunks)

    _queued_then_run(runner, [lambda i=i: run(i) for i in range(3)])
    assert got[0][4] == "cancelled"
    assert got[0][0] == want[0][0][: len(got[0][0])]
    for g, w in zip(got[1:], want[1:], strict=True):
        _assert_same(g, w)
    again = _result(
        runner.stream(conversations[0], max_tokens=24, logprobs=0, batched=True, **GREEDY)
    )
    _assert_same(again, want[0])
    wait_until(lambda: runner._dispatch._batching.batch.num_rows == 0, what="an empty batch")


def test_a_reply_cut_mid_reply_decodes_alone_beside_batched_image_rows(loaded, images, steps):
    """A reply that passes the window cuts its prompt at a message boundary (it decodes
    alone); two image requests decode in the batch meanwhile; each as alone."""
    long = "Describe the picture: the quick brown fox jumps over the lazy dog. " * 8
    cut = [
        {"role": "system", "content": "Be brief."},
        _user(images[1], long),
        {"role": "assistant", "content": "A fox."},
        _user(images[3], "And this?"),
        {"role": "assistant", "content": "A dog."},
        {"role": "user", "content": "Which was first?"},
    ]
    full = len(Runner(loaded).encode(cut))
    window, room = full + 8, 40
    others = [[_user(images[2], "What is this?")], [_user(images[1], "And this one?")]]
    want = [_alone(loaded, cut, max_context=window, max_tokens=room, **GREEDY)]
    want += [_alone(loaded, m, max_context=window, max_tokens=16, **GREEDY) for m in others]
    runner = Runner(loaded, max_context=window, cache_entries=8, max_batch=4, speculative=None)
    each = [{"max_tokens": room}, {"max_tokens": 16}, {"max_tokens": 16}]
    read = _in_step(runner, [cut, *others], each=each, logprobs=0, **GREEDY)
    got = [_result(chunks) for chunks in read]
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert len(got[0][0]) == room
    _assert_most_rows(steps, loaded, 2)  # the cut reply decodes alone


def test_long_and_short_rows_far_apart_in_length_decode_together_as_alone(loaded, images, steps):
    """One image prompt of several hundred tokens, a short image prompt and a short text
    prompt: rows whose left padding differs by hundreds of tokens."""
    long = "The quick brown fox jumps over the lazy dog near the river bank. " * 30
    conversations = [
        [_user(images[1], long + "What is this?")],
        [_user(images[3], "Hm?")],
        [{"role": "user", "content": "Hi"}],
    ]
    want = [_alone(loaded, m, max_tokens=16, **GREEDY) for m in conversations]
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=4, speculative=None)
    read = _in_step(runner, conversations, max_tokens=16, logprobs=0, **GREEDY)
    got = [_result(chunks) for chunks in read]
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    _assert_most_rows(steps, loaded, 3)


def test_the_same_image_prompt_again_in_the_batch_reuses_all_of_it(loaded, images, steps):
    """A prompt the cache holds whole (sent before, serially) decodes in the batch beside
    another, as alone."""
    again = [_user(images[1], "What is this?")]
    other = [_user(images[3], "And this?")]
    want = [_alone(loaded, m, max_tokens=16, **GREEDY) for m in (again, other)]
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=4, speculative=None)
    runner.generate(again, max_tokens=0 + 1, **GREEDY)
    read = _in_step(runner, [again, other], max_tokens=16, logprobs=0, **GREEDY)
    got = [_result(chunks) for chunks in read]
    cached = [chunks[-1].completion.cached_tokens for chunks in read]
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert cached[0] >= len(runner.encode(again)) - 1
    assert (max((rows for rows, _ in steps), default=0) >= 2) == _batches(loaded)


def test_a_request_about_an_image_a_decoding_row_holds_copies_it_and_joins(loaded, images, steps):
    """The first request about an image decodes in the batch; a second about the same image
    comes meanwhile, copies the image's K/V from the first's entry (in use) and joins it."""
    shared = "Look closely at this picture and think about it for a while. " * 3
    first = [_user(images[1], shared + "Colors?")]
    second = [_user(images[1], shared + "Shapes?")]
    want = [_alone(loaded, m, max_tokens=24, **GREEDY) for m in (first, second)]
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=4, speculative=None)
    got: list = [None, None]
    cached: list = [None, None]
    going, started = threading.Event(), threading.Event()

    def run(i):
        stream = runner.stream(
            (first, second)[i], batched=True, max_tokens=24, logprobs=0, **GREEDY
        )
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if i == 0 and len(chunks) == 3:
                going.set()
                assert started.wait(60)
            if i == 1 and len(chunks) == 2:  # its second token: decoded beside the first
                started.set()
        started.set()  # (a second that ended sooner lets the first go on)
        got[i] = _result(chunks)
        cached[i] = chunks[-1].completion.cached_tokens

    def late():
        assert going.wait(60)
        run(1)

    threads = [threading.Thread(target=lambda: run(0)), threading.Thread(target=late)]
    for thread in threads:
        thread.start()
    joined(*threads, timeout_s=120)
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    image_end = max(i for i, t in enumerate(runner.encode(second)) if t >= 1 << 31)
    if _batches(loaded):  # the first waits in the batch until the second has decoded there
        assert max(rows for rows, _ in steps) == 2
    if _batches(loaded) and not make_cache(loaded.model).needs_checkpoints:
        assert cached[1] > image_end, cached  # sliding windows copy from checkpoints only


def test_more_streams_than_rows_with_staggered_starts_each_as_alone(loaded, images, steps):
    """Six streams (four about images of three sizes, two text only) on a batch of three
    rows, started at other moments, with other lengths: some wait for a place, rows join and
    leave at many steps; each answers as alone."""
    asks = [
        ([_user(images[1], "What is this?")], 20),
        ([{"role": "user", "content": "Tell me about caches."}], 9),
        ([_user(images[3], "Describe it.")], 14),
        ([_user(images[2], "And this, please?", images[1], "Compare.")], 25),
        ([{"role": "user", "content": "Hi there, how are you?"}], 17),
        ([_user(images[3], "Once more: what is it?")], 6),
    ]
    want = [_alone(loaded, m, max_tokens=n, logprobs=2, **GREEDY) for m, n in asks]
    runner = Runner(loaded, max_context=1024, cache_entries=16, max_batch=3, speculative=None)
    got: list = [None] * len(asks)
    progressed = [threading.Event() for _ in asks]

    def run(i):
        if i > 0:
            assert progressed[i - 1].wait(60)
        messages, n = asks[i]
        chunks = []
        for chunk in runner.stream(messages, batched=True, max_tokens=n, logprobs=2, **GREEDY):
            chunks.append(chunk)
            if len(chunks) == 2:
                progressed[i].set()
        progressed[i].set()
        got[i] = _result(chunks)

    threads = [threading.Thread(target=lambda i=i: run(i)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    joined(*threads, timeout_s=120)
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert (max((rows for rows, _ in steps), default=0) >= 2) == _batches(loaded)


def _window_conversation(images) -> list[dict]:
    long = "Describe the picture: the quick brown fox jumps over the lazy dog. " * 8
    return [
        {"role": "system", "content": "Be brief."},
        _user(images[1], long),
        {"role": "assistant", "content": "A fox."},
        _user(images[3], "And this?"),
        {"role": "assistant", "content": "A dog."},
        {"role": "user", "content": "Which was first?"},
    ]


def test_the_next_turn_after_a_reply_cut_decodes_in_the_batch_at_the_cut_shift(
    loaded, images, steps
):
    """A reply passes the window and cuts its conversation (alone); the next turn, cut at the
    same message and reusing the entry, decodes in the batch beside another image row."""
    messages = _window_conversation(images)
    full = len(Runner(loaded).encode(messages))
    window, room = full + 8, 40
    runner = Runner(loaded, max_context=window, cache_entries=8, max_batch=4, speculative=None)
    reply = runner.generate(messages, max_tokens=room, **GREEDY)
    turn2 = messages + [
        {"role": "assistant", "content": reply.text},
        {"role": "user", "content": "Sure?"},
    ]
    other = [_user(images[2], "What is this?")]
    reference = Runner(loaded, max_context=window, speculative=None)
    reference.generate(messages, max_tokens=room, **GREEDY)
    want = [_result(reference.stream(turn2, max_tokens=12, logprobs=0, **GREEDY))]
    want.append(_alone(loaded, other, max_context=window, max_tokens=12, **GREEDY))
    read = _in_step(runner, [turn2, other], max_tokens=12, logprobs=0, **GREEDY)
    got = [_result(chunks) for chunks in read]
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert (max((rows for rows, _ in steps), default=0) >= 2) == _batches(loaded)


def test_a_cut_that_drops_every_image_decodes_unshifted_in_the_batch(loaded, images, steps):
    """The prompt cut to the window keeps no image (the image message dropped): its row has
    no shift, beside an image row that has one."""
    cut = _over_the_window(images[1], {"role": "user", "content": "Tell me about caches instead."})
    _cut_beside(loaded, steps, cut, [_user(images[3], "What is this?")])


def test_batched_image_turns_written_to_the_disk_tier_serve_a_restart_as_fresh(
    loaded, images, steps, tmp_path
):
    """Two image conversations decode together on a Runner with a disk tier; a new Runner on
    the same directory answers their next turns as a fresh Runner does."""
    conversations = [[_user(images[1], "What is this?")], [_user(images[3], "And this?")]]
    runner = Runner(
        loaded, max_context=1024, max_batch=4, cache_dir=str(tmp_path), speculative=None
    )
    replies: list = [None, None]

    def run(i):
        chunks = list(runner.stream(conversations[i], batched=True, max_tokens=10, **GREEDY))
        replies[i] = chunks[-1].completion.text

    _queued_then_run(runner, [lambda i=i: run(i) for i in range(2)])
    runner.close()
    later = [
        m + [{"role": "assistant", "content": r}, {"role": "user", "content": "Sure?"}]
        for m, r in zip(conversations, replies, strict=True)
    ]
    want = [_alone(loaded, m, max_tokens=10, **GREEDY) for m in later]
    restarted = Runner(
        loaded, max_context=1024, max_batch=4, cache_dir=str(tmp_path), speculative=None
    )
    got: list = [None, None]
    cached: list = [None, None]

    def again(i):
        chunks = list(restarted.stream(later[i], batched=True, max_tokens=10, logprobs=0, **GREEDY))
        got[i] = _result(chunks)
        cached[i] = chunks[-1].completion.cached_tokens

    _queued_then_run(restarted, [lambda i=i: again(i) for i in range(2)])
    restarted.close()
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert all(c > 0 for c in cached), cached
