"""The cache integrity issue's promises over HTTP, on the paths added since it was resolved:
a vision turn then a text turn on one conversation, image turns long enough to draft, window
and hybrid prompts prefilled together in one batch, and the disk tier across a restart. Each
request's entry is checked by the suite's invariant (`tests/invariants.py`: its tokens are what
its K/V hold), and each answer is compared by log-probabilities with the same request sent to
a fresh server on the same weights (an empty cache: the independent reference)."""

from __future__ import annotations

import base64
import io
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from mlxkv import Runner
from mlxkv.runner import request_run
from mlxkv.runner.hooks import request_ends
from tests.runner.test_multiturn_drafting import _IntermittentDrafter
from tests.server.conftest import serve

LOGPROB_TOLERANCE = 1e-3  # float32 on the CPU; a corrupted cache is off by far more


def _answer(served, messages, model="m", max_tokens=12, **extra):
    """Greedy answer over the OpenAI client: (text, token log-probabilities, cached tokens)."""
    reply = served.openai().chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=True,
        top_logprobs=1,
        **extra,
    )
    choice = reply.choices[0]
    logprobs = [token.logprob for token in choice.logprobs.content]
    return choice.message.content, logprobs, reply.usage.prompt_tokens_details.cached_tokens


def _assert_same(got, want):
    assert got[0] == want[0]
    gaps = [abs(a - b) for a, b in zip(got[1], want[1], strict=True)]
    assert max(gaps, default=0.0) < LOGPROB_TOLERANCE


def _fresh(loaded, messages, **extra):
    """The same request to a new server on the same weights, its cache empty, unspeculated."""
    with serve(Runner(loaded, max_context=1024, speculative=None)) as reference:
        return _answer(reference, messages, **extra)


def _png(seed: int, size: int = 56) -> str:
    from mlxkv.testing.vision_factory import noise_images

    out = io.BytesIO()
    noise_images(seed, [(size, size, 3)])[0].save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _image_message(seed: int, text: str) -> dict:
    image = {"type": "image_url", "image_url": {"url": _png(seed)}}
    return {"role": "user", "content": [image, {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def loaded_vision(tmp_path_factory):
    pytest.importorskip("mlx_vlm")
    from mlxkv.models.loading import load_model
    from mlxkv.testing.vision_factory import build_vision_model

    return load_model(build_vision_model(tmp_path_factory.mktemp("vlm") / "qwen2_vl"))


def test_vision_turn_then_text_turns_then_image_again(loaded_vision, tmp_path):
    """The server's defaults (speculative "auto", a disk tier): an image turn, two text
    turns and an image turn on one conversation each answer as a fresh server does, and
    each reuses the turn before."""
    runner = Runner(loaded_vision, max_context=1024, cache_dir=str(tmp_path / "disk"))
    messages = [_image_message(1, "Describe it in detail, then repeat it.")]
    with serve(runner) as served:
        for turn, follow_up in enumerate(
            ["And again, in other words?", "Once more.", _image_message(2, "And this one?")]
        ):
            got = _answer(served, messages, max_tokens=24)
            _assert_same(got, _fresh(loaded_vision, messages, max_tokens=24))
            if turn:
                assert got[2] > 0, "a later turn reuses the conversation"
            messages = [*messages, {"role": "assistant", "content": got[0]}]
            messages.append(
                follow_up if isinstance(follow_up, dict) else {"role": "user", "content": follow_up}
            )
        _assert_same(_answer(served, messages), _fresh(loaded_vision, messages))
    runner.close()


@pytest.mark.parametrize("arch", ["gemma3_text", "lfm2"])
def test_window_and_hybrid_prompts_prefilled_together(loaded_tiny, arch):
    """Three requests sent at once (two sharing a long prefix) prefill and decode together;
    each answers as a fresh server does, and each entry holds what it fed (the invariant)."""
    loaded = loaded_tiny(arch)
    shared = "the cache keeps what it computed " * 20
    prompts = [shared + "first", shared + "second", "something else entirely " * 8]
    runner = Runner(loaded, max_context=1024)
    with serve(runner) as served:
        for _ in range(2):  # the second round starts from the entries of the first
            with ThreadPoolExecutor(len(prompts)) as pool:
                futures = [
                    pool.submit(_answer, served, [{"role": "user", "content": p}]) for p in prompts
                ]
                answers = [f.result() for f in futures]
            for prompt, got in zip(prompts, answers, strict=True):
                _assert_same(got, _fresh(loaded, [{"role": "user", "content": prompt}]))


def test_drafted_image_turns_then_a_text_turn(loaded_vision, monkeypatch):
    """Image turns decoded speculatively (the drafter proposes the reference reply, one token
    in three wrong: accepted drafts and rejections rolled back), then a text turn, on one
    conversation of a warm server: each answers as a fresh unspeculated server does."""
    warm = Runner(loaded_vision, max_context=1024, speculative="ngram")
    messages = [_image_message(4, "Describe it.")]
    with serve(warm) as served:
        for follow_up in [_image_message(5, "And this?"), "Compare them.", None]:
            got, want = _drafted_turn(served, loaded_vision, messages, monkeypatch)
            _assert_same(got, want)
            if follow_up is None:
                break
            messages = [*messages, {"role": "assistant", "content": got[0]}]
            messages.append(
                follow_up if isinstance(follow_up, dict) else {"role": "user", "content": follow_up}
            )


def _drafted_turn(served, loaded, messages, monkeypatch):
    """(the warm server's answer, drafted from the reference reply, the reference answer)."""
    reply: list[int] = []
    with request_ends(lambda end: reply.extend(end.generated)):
        want = _fresh(loaded, messages, max_tokens=16)
    proposals = []

    def drafter(prompt, vocab_size):
        proposals.append(_IntermittentDrafter(prompt, reply))
        return proposals[-1]

    with monkeypatch.context() as patch:
        patch.setattr(request_run, "NgramDrafter", drafter)
        got = _answer(served, messages, max_tokens=16)
    assert proposals, "the warm server drafted"
    return got, want


def test_disk_tier_across_a_restart(loaded_vision, tmp_path):
    """A conversation with an image, its server closed, a new Runner on the same directory:
    the next turn is served from disk (cached) and answers as a fresh server does."""
    disk = str(tmp_path / "disk")
    messages = [_image_message(3, "What is it?")]
    runner = Runner(loaded_vision, max_context=1024, cache_dir=disk)
    with serve(runner) as served:
        text, _, _ = _answer(served, messages)
    runner.close()
    messages = [*messages, {"role": "assistant", "content": text}]
    messages.append({"role": "user", "content": "Say more."})
    restarted = Runner(loaded_vision, max_context=1024, cache_dir=disk)
    with serve(restarted) as served:
        got = _answer(served, messages)
    restarted.close()
    assert got[2] > 0, "the restarted server reuses the conversation from disk"
    _assert_same(got, _fresh(loaded_vision, messages))


def test_salted_turns_do_not_reuse_each_other(loaded_tiny):
    """Sanity of the reference trick the probes used: a new `cache_salt` starts cold."""
    runner = Runner(loaded_tiny("llama"), max_context=1024)
    messages = [{"role": "user", "content": "hello there " * 10}]
    with serve(runner) as served:
        _answer(served, messages)
        salted = _answer(served, messages, extra_body={"cache_salt": uuid.uuid4().hex})
    assert salted[2] == 0
