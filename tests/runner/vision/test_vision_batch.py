"""A vision model's batched streams (with images or text only) decode in the batch after each
prefilled its own prompt: the same greedy tokens and log-probabilities as each request run
alone on a fresh Runner, per family (Qwen2-VL's M-RoPE rows each shifted by their own images;
Gemma 3's sliding-window layers in mlx-lm's rotating batch), with rows that
join and leave at different steps, an image conversation's next turn reusing its entry, and
two streams sent at once about one image feeding it once. Every entry is checked after every
request by `tests/invariants.py`."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image  # noqa: E402

from mlxkv import Runner  # noqa: E402
from mlxkv.cache.batched import can_batch, can_prefill_together  # noqa: E402
from mlxkv.cache.building import make_cache  # noqa: E402
from mlxkv.decoding import batch as batch_module  # noqa: E402
from mlxkv.runner import assembly  # noqa: E402
from mlxkv.testing.vision_factory import noise_images  # noqa: E402
from tests.factories import joined, recorded, wait_until  # noqa: E402
from tests.runner.conftest import record_batch_steps  # noqa: E402
from tests.runner.test_batching import (  # noqa: E402
    _in_step,
    _queued_then_run,
    _tokens_and_logprobs,
)
from tests.tolerances import LOGPROB_ABS  # noqa: E402

# M-RoPE families: a prompt with images shifts the positions of the tokens after it.
SHIFTING = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
GREEDY = {"temperature": 0.0, "logprobs": 0}


@pytest.fixture(scope="module")
def images():
    """Two images of different sizes (and tokens), and a third."""
    shapes = [(56, 56, 3), (84, 112, 3), (56, 56, 3)]
    return noise_images(1, shapes)


@pytest.fixture
def steps(monkeypatch):
    """(rows, shifted) of every batched step requests took (not the load's warm-up's):
    shifted when the step passed the rows' position shifts to the model."""
    return record_batch_steps(
        monkeypatch, lambda batch: (batch.num_rows, batch._shifts is not None)
    )


def _batches(loaded) -> bool:
    """Whether the model's cache layers batch (`can_batch`): a family whose layers do not
    takes turns, and these tests hold each one that does to the same answers."""
    return can_batch(make_cache(loaded.model))


def _user(*parts) -> dict:
    content = [
        {"type": "image", "image": p} if isinstance(p, Image.Image) else {"type": "text", "text": p}
        for p in parts
    ]
    return {"role": "user", "content": content}


def _conversations(images) -> list[list[dict]]:
    """One image; two images of different sizes; text only."""
    return [
        [_user(images[0], "What is in this picture?")],
        [_user(images[1], "Compare it with", images[2], "the second one, please.")],
        [{"role": "user", "content": "Tell me about caches and batches, briefly."}],
    ]


def _alone(loaded, messages, max_tokens: int):
    """The request on a fresh Runner, decoded alone: (tokens, logprobs)."""
    runner = Runner(loaded, max_context=1024, speculative=None)
    return _tokens_and_logprobs(runner.stream(messages, max_tokens=max_tokens, **GREEDY))


def _assert_same(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ABS)


def test_streams_with_and_without_images_decode_together_as_alone(loaded, images, steps):
    family = loaded.vision.vlm.config.model_type
    conversations = _conversations(images)
    want = [_alone(loaded, messages, 16) for messages in conversations]
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=4, speculative=None)
    got = _in_step(runner, conversations, max_tokens=16, **GREEDY)
    _assert_same([_tokens_and_logprobs(chunks) for chunks in got], want)
    assert len({tuple(tokens) for tokens, _ in want}) == 3, "the model must tell them apart"
    if not _batches(loaded):
        assert not steps, "streams on layers that do not batch take turns"
        return
    assert max(rows for rows, _ in steps) == 3, "the streams never decoded together"
    assert any(shifted for _, shifted in steps) == (family in SHIFTING)


def test_rows_joining_and_leaving_at_other_steps_stay_exact(loaded, images, steps):
    """Two image streams decode; each reader stops after 3 tokens until a third (text only)
    stream has its first token, which then joins them; each leaves at its own length."""
    if not _batches(loaded):
        pytest.skip("the model's cache layers do not batch")
    conversations = _conversations(images)
    lengths = [24, 32, 8]
    want = [_alone(loaded, m, n) for m, n in zip(conversations, lengths, strict=True)]
    # unspeculated: alone, the longest then steps in a batch of one row (speculating, it
    # would leave the batch to draft, and the steps recorded would not show it ending alone)
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=4, speculative=None)
    third_started = threading.Event()
    got: list = [None] * 3

    def early(i):
        stream = runner.stream(conversations[i], batched=True, max_tokens=lengths[i], **GREEDY)
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                assert third_started.wait(60)
        got[i] = _tokens_and_logprobs(chunks)

    def late():
        wait_until(lambda: runner._dispatch._batching.batch.num_rows == 2, what="two rows")
        stream = runner.stream(conversations[2], batched=True, max_tokens=lengths[2], **GREEDY)
        chunks = [next(stream)]
        third_started.set()
        got[2] = _tokens_and_logprobs(chunks + list(stream))

    threads = [threading.Thread(target=t) for t in (lambda: early(0), lambda: early(1), late)]
    for thread in threads:
        thread.start()
    joined(*threads, timeout_s=120)
    _assert_same(got, want)
    counts = [rows for rows, _ in steps]
    assert 3 in counts and counts[-1] == 1, "the third joined the two; the longest ended alone"


def test_next_turn_of_an_image_conversation_reuses_its_entry_in_the_batch(loaded, images, steps):
    if not _batches(loaded):
        pytest.skip("the model's cache layers do not batch")
    first, other, _ = _conversations(images)
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=4, speculative=None)
    got: list = [None, None]

    def run(i, messages):
        got[i] = list(runner.stream(messages, batched=True, max_tokens=12, **GREEDY))

    _queued_then_run(runner, [lambda: run(0, first), lambda: run(1, other)])
    turn_one = got[0][-1].completion
    second = first + [
        {"role": "assistant", "content": turn_one.text},
        _user("And the colors?"),
    ]
    want = _alone(loaded, second, 12)
    del steps[:]
    got = _in_step(runner, [second, other], max_tokens=12, **GREEDY)
    completion = got[0][-1].completion
    # what the same two turns reuse one at a time: the first's prompt (its image) at least,
    # and its reply where its text renders back to its tokens; a model with sliding windows
    # goes back to its checkpoint where the first's generation prompt begins
    serial = Runner(loaded, max_context=1024, cache_entries=8, speculative=None)
    serial.generate(first, max_tokens=12, **GREEDY)
    reused = serial.generate(second, max_tokens=12, **GREEDY).cached_tokens
    windows = make_cache(loaded.model).needs_checkpoints
    assert completion.cached_tokens == reused >= (1 if windows else turn_one.prompt_tokens)
    _assert_same([_tokens_and_logprobs(got[0])], [want])
    assert max(rows for rows, _ in steps) == 2


def test_warm_up_runs_a_batched_step_where_the_vision_model_batches(loaded, monkeypatch):
    """Its two scratch prompts (text ids, as its text-only prompts) prefilled together where
    the cache layers allow, then one batched step of both, where they batch."""
    together = recorded(monkeypatch, assembly, "prefill_together", lambda *args: len(args[1]))
    steps = recorded(monkeypatch, batch_module.DecodeBatch, "_step", lambda b: b.num_rows)
    runner = Runner(loaded, max_context=256, max_batch=4, speculative=None)
    assert together == ([2] if can_prefill_together(make_cache(loaded.model)) else [])
    assert steps == ([2] if _batches(loaded) else [])
    assert runner.cache_info().num_tokens == 0


def test_the_batched_decode_probe_at_load_keeps_the_vision_models_batch(loaded, monkeypatch):
    """The probe at load (`probe_batched_decode`) runs for a vision model as for a text one
    and finds its rows exact: its step feeds uint32 ids, as every step does (int32 ones
    cannot be compared with the placeholders' ids, from 2**31: the probe raised in every
    family and sent each to decode alone)."""
    probed = recorded(monkeypatch, assembly, "probe_batched_decode", lambda *args: args[2])
    runner = Runner(loaded, max_context=256, max_batch=4, speculative=None, warmup=False)
    assert probed == ([4] if _batches(loaded) else [])
    assert runner.max_batch == 4


def test_streams_sent_at_once_about_one_image_feed_it_once(loaded, images, steps):
    """The second waits for the first to feed the image and the shared text, copies them,
    and both decode together (read in step: `_in_step`), as each would alone."""
    shared = "Look closely at this picture and think about it for a while. " * 4
    conversations = [[_user(images[0], shared + ending)] for ending in ("Colors?", "Shapes?")]
    want = [_alone(loaded, messages, 12) for messages in conversations]
    # prefilled in several chunks, the second's turns come while the first's prompt is fed
    runner = Runner(
        loaded,
        max_context=1024,
        cache_entries=8,
        max_batch=4,
        prefill_step_size=8,
        speculative=None,
    )
    runs = loaded.vision.encoder_runs
    # read in step: the first could otherwise decode all its tokens before the second joins
    got = _in_step(runner, conversations, max_tokens=12, **GREEDY)
    _assert_same([_tokens_and_logprobs(chunks) for chunks in got], want)
    cached = sorted(chunks[-1].completion.cached_tokens for chunks in got)
    image_end = max(i for i, t in enumerate(runner.encode(conversations[0])) if t >= 1 << 31)
    assert cached[0] == 0 and cached[1] > image_end, "the second copied the image's K/V"
    assert loaded.vision.encoder_runs == runs + 1
    if _batches(loaded):
        assert max(rows for rows, _ in steps) == 2
