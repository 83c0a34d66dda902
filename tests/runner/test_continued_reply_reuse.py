"""A continued reply (the last assistant message left open: Anthropic's prefill) comes back as
one assistant message, the prefill and the reply's text together; the next turn reuses all
that the cache holds (the prompt, the prefill's ids as the turn fed them, the reply's ids),
also after a restart on the same disk tier, and answers as a Runner with no cache does on the
same messages (log-probabilities). So does a reply continued after a template text that shares
a token with the prefill (`Assistant: The`), whose text keeps its first token's space."""

from __future__ import annotations

import numpy as np
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.runner.text.chat import CONTINUE_FINAL
from mlxkv.testing.factory import build_model
from tests.runner.test_continue_final import SPACED_TEMPLATE

CONTINUE = {CONTINUE_FINAL: True}
QUESTION = [{"role": "user", "content": "Tell me a story"}]
PREFILL = "Once upon"


def _sent_back(whole: str) -> list[dict]:
    """The next turn as a client sends it: the prefill and the reply as one message."""
    assistant = {"role": "assistant", "content": whole}
    return [*QUESTION, assistant, {"role": "user", "content": "And then?"}]


def encodes_otherwise(runner: Runner, asked: list[dict], text: str, held: list[int]) -> bool:
    """Whether the assistant `text` after the chat `asked`, encoded as text, differs from
    the ids the cache holds for it (`held`, the turn that continued it): the case at hand."""
    start = len(runner.encode(asked))  # the prompt through the generation prompt
    as_text = runner.tokenizer.encode(text, add_special_tokens=False)
    return held[start:] != as_text[: len(held) - start]


def _continued(runner: Runner, prefill: str = PREFILL) -> tuple[str, list[int]]:
    """A turn continuing `prefill`: the whole assistant text the client sends back, and the
    ids the cache holds after it."""
    prefilled = [*QUESTION, {"role": "assistant", "content": prefill}]
    reply = runner.generate(prefilled, max_tokens=8, temperature=0, switches=CONTINUE)
    assert reply.text and reply.finish_reason == "length"
    held = runner.cache_tokens
    assert encodes_otherwise(runner, QUESTION, prefill + reply.text, held)
    return prefill + reply.text, held


def _answer(runner: Runner, prompt) -> tuple:
    chunks = list(runner.stream(prompt, max_tokens=4, temperature=0, logprobs=0))
    return chunks[-1].completion, [c.logprob.logprob for c in chunks if c.logprob]


def _check_next_turn(runner: Runner, reference: Runner, whole: str, held: list[int]) -> None:
    """The next turn reuses everything `held` and answers as `reference` (no cache) does."""
    got, got_logprobs = _answer(runner, _sent_back(whole))
    assert got.cached_tokens == len(held)
    want, want_logprobs = _answer(reference, _sent_back(whole))
    assert want.cached_tokens == 0 and got.prompt_tokens == want.prompt_tokens
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got_logprobs, want_logprobs, atol=1e-4)


@pytest.mark.parametrize(
    "prefill", [PREFILL, "red<|im_end|>"], ids=["text", "control-token-text"]
)  # the second one's ids are its plain text's (`text.controls`)
def test_a_continued_reply_sent_back_whole_is_reused_in_full(loaded_tiny, prefill):
    runner = Runner(loaded_tiny("llama"), max_context=1024)
    whole, held = _continued(runner, prefill)
    _check_next_turn(runner, Runner(loaded_tiny("llama"), max_context=1024), whole, held)


def test_a_reply_continued_again_is_reused_in_full(loaded_tiny):
    """A reply generated here, continued ("go on" after max_tokens): the continued message
    takes the first reply's ids, the whole text sent back both replies' ids."""
    runner = Runner(loaded_tiny("llama"), max_context=1024)
    first = runner.generate(QUESTION, max_tokens=6, temperature=0)
    whole, held = _continued(runner, first.text)
    _check_next_turn(runner, Runner(loaded_tiny("llama"), max_context=1024), whole, held)


def test_a_continued_reply_is_reused_in_full_after_a_restart(tmp_path_factory, tmp_path):
    """Models loaded afresh (a new tokenizer: a new reply memory, what the disk kept)."""
    path = build_model("llama", tmp_path_factory.mktemp("restart") / "llama")
    before = Runner(load_model(path), max_context=1024, cache_dir=tmp_path)
    whole, held = _continued(before)
    before.close()
    restarted = Runner(load_model(path), max_context=1024, cache_dir=tmp_path, cache_entries=2)
    reference = Runner(load_model(path), max_context=1024)  # no disk tier: renders as text
    want_ids = restarted.encode(_sent_back(whole))
    assert want_ids[: len(held)] == held  # the restart renders the reply as the cache holds it
    got, got_logprobs = _answer(restarted, _sent_back(whole))
    assert got.cached_tokens == len(held)  # the prompt, the prefill and the reply, from disk
    want, want_logprobs = _answer(reference, want_ids)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got_logprobs, want_logprobs, atol=1e-4)


@pytest.fixture(scope="module")
def spaced(tmp_path_factory):
    """A model whose template writes `Assistant: {content}` after a generation prompt
    `Assistant:` (SmolVLM's way): a continued prefill's first word takes the space (` The`)."""
    path = build_model(
        "llama", tmp_path_factory.mktemp("spaced") / "m", chat_template=SPACED_TEMPLATE
    )
    return load_model(path)


def _spaced_continued(runner: Runner) -> tuple[list[dict], object, str]:
    """The first of a few prefills whose greedy continuation begins with a spaced token (a
    random model: found, not assumed), that reply, and its first token's text as the prompt's
    and the reply's ids decode together (the independent reference)."""
    tokenizer = runner.tokenizer
    for i in range(30):
        prefilled = [*QUESTION, {"role": "assistant", "content": f"The colour {i} is"}]
        reply = runner.generate(prefilled, max_tokens=8, temperature=0, switches=CONTINUE)
        before = tokenizer.decode(runner.encode(prefilled, switches=CONTINUE))
        first = tokenizer.decode(runner.encode(prefilled, switches=CONTINUE) + reply.tokens[:1])
        first = first[len(before) :]
        if first[:1].isspace() and first.strip() and "\ufffd" not in first:
            return prefilled, reply, first
    pytest.skip("no continued reply of 30 began with a spaced token")


def test_a_prefill_sharing_a_token_with_the_template_is_reused_in_full(spaced):
    """The prefill's ids after the template's `Assistant:` (less the space they hold) are the
    reply's start: the reply sent back whole renders as the ids the cache holds, reads as the
    template renders its text (one space, not two), and answers as a fresh Runner does."""
    runner = Runner(spaced, max_context=1024)
    prefilled, first, _ = _spaced_continued(runner)
    held = runner.cache_tokens
    whole = prefilled[-1]["content"] + first.text
    assert "Assistant:  " not in runner.tokenizer.decode(runner.encode(_sent_back(whole)))
    _check_next_turn(runner, Runner(spaced, max_context=1024), whole, held)


def test_a_prefill_sharing_a_token_with_the_template_streams_its_replys_space(spaced):
    """The reply's text keeps its first token's space (`is Paris`, not `isParis`) as the
    prompt's and the reply's ids decode together, and streams as it is generated whole."""
    runner = Runner(spaced, max_context=1024)
    prefilled, reply, first = _spaced_continued(runner)
    assert reply.text.startswith(first)
    streamed = Runner(spaced, max_context=1024).stream(
        prefilled, max_tokens=8, temperature=0, switches=CONTINUE
    )
    assert "".join(chunk.text for chunk in streamed) == reply.text


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_continued_replys_text_keeps_its_first_tokens_space(loaded_tiny, arch):
    """A reply continuing a message begins with its first token's text as the whole decodes it
    after the prefill (the independent reference): ` time` after `Once upon` reads ` time`, not
    `time` (a client shows the prefill and the reply joined: `Once upontime`)."""
    runner = Runner(loaded_tiny(arch), max_context=512)
    tokenizer = runner.tokenizer
    for i in range(30):
        prefilled = [*QUESTION, {"role": "assistant", "content": f"Once upon {i}"}]
        reply = runner.generate(prefilled, max_tokens=6, temperature=0, switches=CONTINUE)
        prompt = runner.encode(prefilled, switches=CONTINUE)
        before = tokenizer.decode(prompt)
        first = tokenizer.decode(prompt + reply.tokens[:1])[len(before) :]
        if first[:1].isspace() and first.strip() and "\ufffd" not in first:
            break
    else:
        pytest.skip("no continued reply of 30 began with a spaced token")
    assert reply.text.startswith(first)
