"""A continued reply sent back by the real clients as one assistant message, the prefill and
the reply together (as Anthropic's docs tell users to, and as the SDKs and Claude Code do):
the next turn reuses all the cache holds, the prefill's and the reply's ids included, and
answers as a fresh Runner with no cache does on the same messages; so after a restart on the
same disk tier."""

from __future__ import annotations

import ollama
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.testing.factory import build_model
from tests.runner.test_continued_reply_reuse import encodes_otherwise
from tests.server.conftest import serve

PREFILL = "Once upon"
MAX_TOKENS = 8
GREEDY = {"temperature": 0}  # this anthropic client takes no temperature of its own


@pytest.fixture(scope="module")
def served(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=1024)) as server:
        yield server


def _prefilled(question: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": PREFILL}]


def _sent_back(question: str, reply: str) -> list[dict]:
    """Turn 2 as the clients send it: the prefill and the reply in one assistant message."""
    whole = {"role": "assistant", "content": PREFILL + reply}
    return [{"role": "user", "content": question}, whole, {"role": "user", "content": "Go on"}]


def _reference(loaded, messages: list[dict]):
    """Turn 2 on a fresh Runner (no cache), as the server's chat renders it."""
    runner = Runner(loaded, max_context=1024)
    chunks = list(runner.stream(messages, max_tokens=4, temperature=0, logprobs=0))
    assert chunks[-1].completion.cached_tokens == 0
    return chunks[-1].completion.text, [c.logprob.logprob for c in chunks if c.logprob]


def _check_the_case(served, question: str, reply: str) -> list[int]:
    """The ids the cache holds after turn 1, checked to differ from the text encoded."""
    held = list(served.runner.cache_tokens)
    asked = [{"role": "user", "content": question}]
    assert encodes_otherwise(served.runner, asked, PREFILL + reply, held)
    return held


def test_anthropic_prefill_sent_back_is_reused_in_full(served, loaded_tiny):
    client = served.anthropic()
    question = "Tell me a story"
    first = client.messages.create(
        model="m", messages=_prefilled(question), max_tokens=MAX_TOKENS, extra_body=GREEDY
    )
    reply = first.content[0].text
    held = _check_the_case(served, question, reply)
    messages = _sent_back(question, reply)
    with client.messages.stream(model="m", messages=messages, max_tokens=4, extra_body=GREEDY) as s:
        second = s.get_final_message()
    assert second.usage.cache_read_input_tokens == len(held)
    assert second.content[0].text == _reference(loaded_tiny("llama"), messages)[0]


def test_openai_continue_final_message_sent_back_is_reused_in_full(served, loaded_tiny):
    client = served.openai()
    question = "Tell me a tale"
    first = client.chat.completions.create(
        model="m",
        messages=_prefilled(question),
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"continue_final_message": True},
    )
    reply = first.choices[0].message.content
    held = _check_the_case(served, question, reply)
    messages = _sent_back(question, reply)
    second = client.chat.completions.create(
        model="m", messages=messages, max_tokens=4, temperature=0, logprobs=True
    )
    assert second.usage.prompt_tokens_details.cached_tokens == len(held)
    text, logprobs = _reference(loaded_tiny("llama"), messages)
    assert second.choices[0].message.content == text
    got = [t.logprob for t in second.choices[0].logprobs.content]
    assert got == pytest.approx(logprobs, abs=1e-4)


def test_ollama_chat_prefill_sent_back_is_reused_in_full(served, loaded_tiny):
    client = ollama.Client(host=served.url)
    question = "Tell me a fable"
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    first = client.chat(model="m", messages=_prefilled(question), options=options)
    reply = first.message.content
    held = _check_the_case(served, question, reply)
    messages = _sent_back(question, reply)
    second = client.chat(model="m", messages=messages, options={**options, "num_predict": 4})
    # Ollama reports no cached count: the second prompt starts with all the first turn held
    assert served.runner.cache_tokens[: len(held)] == held
    assert second.message.content == _reference(loaded_tiny("llama"), messages)[0]


def test_after_a_restart_a_prefill_sent_back_is_reused_in_full(tmp_path_factory, tmp_path):
    """A server restarted on the same disk tier, its model loaded afresh (its reply memory is
    what the disk kept), reads the whole turn from disk."""
    path = build_model("llama", tmp_path_factory.mktemp("restart") / "llama")
    question = "Tell me a legend"
    before = Runner(load_model(path), max_context=1024, cache_dir=tmp_path)
    with serve(before) as s:
        first = s.anthropic().messages.create(
            model="m", messages=_prefilled(question), max_tokens=MAX_TOKENS, extra_body=GREEDY
        )
        reply = first.content[0].text
        held = _check_the_case(s, question, reply)
    before.close()
    messages = _sent_back(question, reply)
    restarted = Runner(load_model(path), max_context=1024, cache_dir=tmp_path, cache_entries=2)
    want_ids = restarted.encode(messages)
    assert want_ids[: len(held)] == held
    with serve(restarted) as s:
        second = s.openai().chat.completions.create(
            model="m", messages=messages, max_tokens=4, temperature=0, logprobs=True
        )
    assert second.usage.prompt_tokens_details.cached_tokens == len(held)
    reference = Runner(load_model(path), max_context=1024)  # its memory empty: given the ids
    chunks = list(reference.stream(want_ids, max_tokens=4, temperature=0, logprobs=0))
    assert second.choices[0].message.content == chunks[-1].completion.text
    got = [t.logprob for t in second.choices[0].logprobs.content]
    assert got == pytest.approx([c.logprob.logprob for c in chunks if c.logprob], abs=1e-4)
