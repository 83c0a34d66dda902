"""Review probes of efd8117 (requests with images decode speculatively, n-gram drafts; drafts
stop at the window): each speculative reply against plain decoding on a fresh Runner (greedy
tokens, log-probabilities within `LOGPROB_ABS`), in cases the merged tests do not cover: the
hand-over to the batch and back (`_alone_or_batched` with a row's position shift), a stop
string inside an accepted draft, a caller leaving mid-draft, sampled drafts, a draft model
loaded beside a vision model, and a text reply shifted mid-reply (the new `_in_window` rule).
Every entry is checked after every request by `tests/invariants.py`."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm")

from mlxkv import Runner  # noqa: E402
from mlxkv.cache.model_cache import ModelCache  # noqa: E402
from mlxkv.decoding import decoders  # noqa: E402
from mlxkv.models.loading import load_model  # noqa: E402
from mlxkv.runner import request_run  # noqa: E402
from mlxkv.testing.factory import ARCHITECTURES  # noqa: E402
from mlxkv.testing.vision_factory import build_vision_model, noise_images  # noqa: E402
from tests.factories import recorded  # noqa: E402
from tests.runner.vision.test_vision_batch_edges import (  # noqa: E402
    GREEDY,
    _alone,
    _assert_same,
    _result,
    _speculating_then_joined,
    _user,
)
from tests.runner.vision.test_vision_window import _ReplyDrafter  # noqa: E402
from tests.tolerances import LOGPROB_ABS  # noqa: E402


@pytest.fixture(scope="module")
def images():
    return noise_images(5, [(56, 56, 3), (84, 112, 3), (112, 56, 3)])


def _drafting(monkeypatch, reply):
    monkeypatch.setattr(
        request_run, "NgramDrafter", lambda prompt, vocab_size: _ReplyDrafter(prompt, reply)
    )


def test_an_image_request_speculating_alone_then_joined_and_left_stays_exact(
    loaded, images, monkeypatch
):
    """An image request speculates while alone (every draft right), a text request and an image
    request come: it joins their batch with its position shift (`joined_tokens`), and goes on
    alone speculating when they are done: plain decoding's tokens and log-probabilities."""
    first_msgs = [_user(images[0], "Describe it at length.")]
    others = [[{"role": "user", "content": "Say something."}], [_user(images[1], "And this?")]]
    want_first = _alone(loaded, first_msgs, max_tokens=48, logprobs=3, **GREEDY)
    want = [_alone(loaded, m, max_tokens=10, **GREEDY) for m in others]
    _drafting(monkeypatch, [*want_first[0], *loaded.tokenizer.eos_token_ids])
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=4)
    rejoined = recorded(monkeypatch, decoders, "joined_tokens", lambda *a, **k: k["position_shift"])
    first_options = {"max_tokens": 48, "logprobs": 3}
    got = _speculating_then_joined(
        runner, first_msgs, others, first_options=first_options, later_tokens=10, join_s=180
    )
    _assert_same(got[0], want_first)
    for g, w in zip(got[1:3], want, strict=True):
        _assert_same(g, w)
    assert rejoined, "the image request never joined the batch from speculation"


def test_a_stop_string_inside_an_accepted_draft_on_an_image_prompt(loaded, images, monkeypatch):
    """Every draft right, a stop string inside one: plain decoding's text, and the next turn
    reuses and answers as plain decoding's."""
    messages = [_user(images[0], "What is this?")]
    reference = _alone(loaded, messages, max_tokens=24, **GREEDY)
    text = reference[3]
    assert len(text) > 12, "a reply too short to stop inside"
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want = _alone(loaded, messages, max_tokens=24, stop=[stop], **GREEDY)
    _drafting(monkeypatch, [*reference[0], *loaded.tokenizer.eos_token_ids])
    drafted = Runner(loaded, max_context=1024)
    got = _result(drafted.stream(messages, max_tokens=24, stop=[stop], logprobs=0, **GREEDY))
    assert got[3] == want[3] and got[4] == want[4]
    plain = Runner(loaded, max_context=1024, speculative=None)
    plain.generate(messages, max_tokens=24, stop=[stop], **GREEDY)
    turn2 = messages + [
        {"role": "assistant", "content": got[3]},
        {"role": "user", "content": "Again?"},
    ]
    a = drafted.generate(turn2, max_tokens=8, **GREEDY)
    b = plain.generate(turn2, max_tokens=8, **GREEDY)
    assert a.tokens == b.tokens
    assert a.cached_tokens == b.cached_tokens


def test_a_caller_leaving_mid_draft_leaves_an_entry_the_next_turn_reuses(
    loaded, images, monkeypatch
):
    """The reader stops after a few chunks of a drafted reply (drafts of 4+ accepted ahead):
    the entry holds what was fed (invariants) and the same prompt again answers as plain."""
    messages = [_user(images[2], "Describe it.")]
    reference = _alone(loaded, messages, max_tokens=30, **GREEDY)
    _drafting(monkeypatch, [*reference[0], *loaded.tokenizer.eos_token_ids])
    runner = Runner(loaded, max_context=1024)
    stream = runner.stream(messages, max_tokens=30, logprobs=0, speculative="ngram", **GREEDY)
    read = [next(stream) for _ in range(7)]
    assert read[-1].completion is None, "the reply ended before the caller left"
    stream.close()
    again = _result(runner.stream(messages, max_tokens=30, logprobs=0, **GREEDY))
    _assert_same(again, reference)


def test_a_sampled_image_reply_with_drafts_is_seeded_and_draws_only_tokens(loaded, images):
    """Temperature 0.9, seeded, n-gram drafts (a prompt that repeats itself): the same reply on
    two fresh Runners, every id a token of the vocabulary."""
    words = "red blue green red blue green red blue green red blue green"
    messages = [_user(images[0], f"Repeat: {words}")]
    options = {"max_tokens": 32, "temperature": 0.9, "seed": 3, "speculative": "ngram"}
    a = Runner(loaded, max_context=1024).generate(messages, **options)
    b = Runner(loaded, max_context=1024).generate(messages, **options)
    assert a.tokens == b.tokens
    assert all(t < loaded.vocab_size for t in a.tokens)


def test_a_draft_model_beside_a_vision_model_drafts_text_only(loaded, images):
    """The vision model's own language model loaded as the draft model (same tokenizer): an
    image request with speculative="draft" drafts n-grams (nothing feeds images to the draft
    model), a text request drafts with the draft model; both give plain decoding's tokens."""
    draft = dataclasses.replace(loaded, vision=None)
    runner = Runner(loaded, max_context=1024, draft=draft)
    for messages in (
        [_user(images[0], "What is this?")],
        [{"role": "user", "content": "Say something long."}],
        [_user(images[0], "What is this?")],
    ):
        want = _alone(loaded, messages, max_tokens=16, **GREEDY)
        got = _result(
            runner.stream(messages, max_tokens=16, logprobs=0, speculative="draft", **GREEDY)
        )
        _assert_same(got, want)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_text_reply_shifted_mid_reply_with_drafts_equals_plain(
    loaded_tiny, arch, monkeypatch, caplog
):
    """A text reply that passes the window (shift), drafted wholly right: the shift comes at
    the same token as plain decoding's (drafts cut at the window) and the reply after it is
    plain decoding's, log-probabilities within tolerance."""
    loaded = loaded_tiny(arch)
    messages = [{"role": "user", "content": "Count the colors: red blue green red blue green."}]
    full = len(Runner(loaded).encode(messages))
    options = {"max_tokens": 40, "temperature": 0.0, "logprobs": 0}
    plain = Runner(loaded, max_context=full + 6, speculative=None)
    with caplog.at_level(logging.INFO):
        want_chunks = list(plain.stream(messages, **options))
    want = want_chunks[-1].completion
    assert len(want.tokens) > 12, "too short a reply to shift"
    assert any("context shift" in r.getMessage() for r in caplog.records)
    _drafting(monkeypatch, [*want.tokens, *loaded.tokenizer.eos_token_ids])
    drafted = Runner(loaded, max_context=full + 6)
    chunks = list(drafted.stream(messages, speculative="ngram", **options))
    got = chunks[-1].completion
    assert got.drafted_tokens > 0
    assert got.tokens == want.tokens
    assert [c.logprob.logprob for c in chunks[:-1]] == pytest.approx(
        [c.logprob.logprob for c in want_chunks[:-1]], abs=LOGPROB_ABS
    )


_PENALIZED_IMAGE_PROMPT = """
import sys
from pathlib import Path
from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.testing.vision_factory import build_vision_model, noise_images
loaded = load_model(build_vision_model(Path(sys.argv[1]), family=sys.argv[2]))
image = noise_images(5, [(56, 56, 3)])[0]
content = [{"type": "image", "image": image}, {"type": "text", "text": "What is this?"}]
runner = Runner(loaded, max_context=1024, speculative=None)
out = runner.generate([{"role": "user", "content": content}], max_tokens=4,
                      temperature=0.0, repetition_penalty=1.3)
print("tokens", out.tokens)
"""


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_repetition_penalty_on_an_image_prompt_does_not_crash_the_process(tmp_path, family):
    """The repetition penalty (OpenAI `repetition_penalty`, Ollama `repeat_penalty`) reads the
    last 20 ids of the history, which on a prompt with an image a short question after it are
    image placeholders (`PLACEHOLDER_BASE` and up, past the vocabulary): mlx-lm's processor
    gathers and scatters the logits at those ids, out of bounds, and the process dies with
    SIGSEGV (plain decoding; speculative and batched picks share the processors). Run in a
    subprocess so that the crash fails this test, not the session."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", _PENALIZED_IMAGE_PROMPT, str(tmp_path / family), family],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "tokens" in done.stdout


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_text_reply_shifted_mid_reply_with_a_draft_model_equals_plain(loaded_tiny, arch):
    """The model as its own draft model (every greedy draft right) on a reply that passes the
    window several times: plain decoding's tokens; the draft model follows each shift
    (`tests/decoding/test_draft_model_window.py` counts its drafts after them)."""
    loaded = loaded_tiny(arch)
    messages = [{"role": "user", "content": "Count the colors: red blue green red blue green."}]
    full = len(Runner(loaded).encode(messages))
    options = {"max_tokens": 80, "temperature": 0.0, "logprobs": 0}
    plain = Runner(loaded, max_context=full + 8, speculative=None)
    want_chunks = list(plain.stream(messages, **options))
    want = want_chunks[-1].completion
    assert len(want.tokens) > 40, "too short a reply to shift several times"
    drafted = Runner(loaded, max_context=full + 8, draft=dataclasses.replace(loaded))
    chunks = list(drafted.stream(messages, speculative="draft", **options))
    got = chunks[-1].completion
    assert got.drafted_tokens > 0
    assert got.tokens == want.tokens
    assert [c.logprob.logprob for c in chunks[:-1]] == pytest.approx(
        [c.logprob.logprob for c in want_chunks[:-1]], abs=LOGPROB_ABS
    )
    turn2 = messages + [
        {"role": "assistant", "content": got.text},
        {"role": "user", "content": "Shorter?"},
    ]
    short = {"max_tokens": 12, "temperature": 0.0}
    again = drafted.generate(turn2, speculative="draft", **short)
    assert again.tokens == plain.generate(turn2, **short).tokens


def test_drafted_image_replies_across_a_disk_snapshot_boundary_serve_a_restart(
    tmp_path, images, monkeypatch
):
    """Gemma 3 (sliding-window layers: the disk tier snapshots every 256 tokens): an image
    prompt just under the boundary, its reply drafted wholly right across it: no verification
    pass crosses the boundary (`_to_snapshot`), and a restarted Runner answers the next turn
    from disk as after a plain reply (the same tokens, the same cached count)."""
    loaded = load_model(build_vision_model(tmp_path / "gemma3", family="gemma3"))
    words = "one two three four five six seven eight nine ten " * 40
    messages = []
    for n in range(1, 80):
        # images[1]: the greedy reply about images[0] ends after 11 tokens
        messages = [_user(images[1], words[: 6 * n])]
        if len(Runner(loaded).encode(messages)) >= 230:
            break
    assert 230 <= len(Runner(loaded).encode(messages)) < 250
    want = _alone(loaded, messages, max_tokens=60, **GREEDY)
    assert len(want[0]) == 60, "a reply that ends before the boundary"
    _drafting(monkeypatch, [*want[0], *loaded.tokenizer.eos_token_ids])
    passes = []
    tentative = ModelCache.forward_tentative

    def recorded_pass(cache, model, token_ids):
        passes.append((cache.num_tokens, len(token_ids), cache.snapshot_every_tokens))
        return tentative(cache, model, token_ids)

    monkeypatch.setattr(ModelCache, "forward_tentative", recorded_pass)
    answers = {}
    for speculative in (None, "ngram"):
        kv = tmp_path / f"kv-{speculative}"
        before = Runner(loaded, cache_dir=kv)
        options = {"max_tokens": 60, "logprobs": 0, "speculative": speculative, **GREEDY}
        got = _result(before.stream(messages, **options))
        _assert_same(got, want)
        before.close()
        turn2 = messages + [
            {"role": "assistant", "content": got[3]},
            {"role": "user", "content": "Again?"},
        ]
        answer = Runner(loaded, cache_dir=kv).generate(turn2, max_tokens=6, temperature=0.0)
        answers[speculative] = (answer.tokens, answer.cached_tokens)
    assert answers["ngram"] == answers[None]
    assert passes and all(every == 256 for _, _, every in passes)
    crossing = [(at, n) for at, n, _ in passes if at < 256 < at + n]
    assert not crossing, crossing


def test_a_cancel_mid_draft_ends_the_reply_and_the_next_turn_answers_as_plain(
    loaded, images, monkeypatch
):
    """The request's cancel Event set after a few chunks of a drafted reply (drafts of 4 and
    more accepted, tokens yielded ahead of the reader): it ends "cancelled", its entry holds
    what it fed (invariants), and the same conversation's next turn answers as plain."""
    messages = [_user(images[1], "Describe it.")]
    reference = _alone(loaded, messages, max_tokens=30, **GREEDY)
    _drafting(monkeypatch, [*reference[0], *loaded.tokenizer.eos_token_ids])
    runner = Runner(loaded, max_context=1024)
    cancel = threading.Event()
    chunks = []
    options = {"max_tokens": 30, "logprobs": 0, "speculative": "ngram", **GREEDY}
    for chunk in runner.stream(messages, cancel=cancel, **options):
        chunks.append(chunk)
        if len(chunks) == 5:
            cancel.set()
    done = chunks[-1].completion
    assert done.finish_reason == "cancelled"
    assert done.tokens == reference[0][: len(done.tokens)]
    assert len(done.tokens) < 30
    turn2 = messages + [
        {"role": "assistant", "content": done.text},
        {"role": "user", "content": "Go on."},
    ]
    got = _result(runner.stream(turn2, max_tokens=8, logprobs=0, **GREEDY))
    _assert_same(got, _alone(loaded, turn2, max_tokens=8, **GREEDY))


def test_a_drafted_reply_that_cuts_twice_then_finds_no_room_ends_as_plain(loaded, monkeypatch):
    """A reply with images that reaches the window, cuts, reaches it again, cuts again and then
    has no whole message left to drop (`ImageWindow.make_room` False), drafted wholly right:
    plain decoding's tokens and log-probabilities, ending where it ends ("length")."""
    from tests.runner.vision.test_vision_window import ROOM, _short_conversation

    messages = _short_conversation(Runner(loaded))
    full = len(Runner(loaded).encode(messages))
    options = {"max_tokens": 4 * (full + ROOM), "logprobs": 0, **GREEDY}
    want = _result(
        Runner(loaded, max_context=full + ROOM, speculative=None).stream(messages, **options)
    )
    assert want[4] == "length" and len(want[0]) < full + ROOM
    _drafting(monkeypatch, [*want[0], *loaded.tokenizer.eos_token_ids])
    runner = Runner(loaded, max_context=full + ROOM)
    got = _result(runner.stream(messages, speculative="ngram", **options))
    _assert_same(got, want)
