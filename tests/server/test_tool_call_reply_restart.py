"""A tool-call reply sent back after a restart takes the ids the model generated: the Runner
keeps it by what the client sends back (`turn.reply_keyer`: its text and calls), in one slot of
the reply memory and one record of the disk tier, which a Runner started on the same cache
directory (its model loaded afresh, so its reply memory new) restores; the next turn then
reuses the whole first turn from disk and answers as a fresh Runner given those ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.runner.disk.replies import REPLY_SUFFIX
from mlxkv.runner.text.replies import replies_for
from mlxkv.testing.factory import build_scripted_model
from tests.server.conftest import SCRIPT, WEATHER, serve
from tests.server.test_tool_call_reply_edges import ASK, _sent_back, _template_text


@pytest.fixture(scope="module")
def scripted_path(tmp_path_factory) -> Path:
    return build_scripted_model(tmp_path_factory.mktemp("tools") / "model", SCRIPT)


def _runner(path: Path, cache_dir: Path | None) -> Runner:
    """A Runner of a model loaded afresh: its tokenizer (so its reply memory) is new, as in a
    restarted process."""
    return Runner(load_model(path), max_context=512, cache_dir=cache_dir)


def _first_turn(path: Path, cache_dir: Path) -> tuple[list[dict], list[int], list[int]]:
    """The second turn's messages (the call reply and its result), the ids the cache holds
    after the first turn, and the second prompt as the process that generated the reply
    renders it; the Runner is closed after (its writes finished)."""
    runner = _runner(path, cache_dir)
    with serve(runner, model_name="m") as served:
        first = served.openai().chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], max_tokens=40
        )
    messages = _sent_back(first.choices[0].message)
    held, want_ids = runner.cache_tokens, runner.encode(messages, tools=[WEATHER])
    keys = [key for _, key, _, _ in replies_for(runner.tokenizer).items()]
    runner.close()
    assert len(keys) == 1 and keys[0].startswith("\0calls")  # one slot: by its calls alone
    assert len(list(cache_dir.rglob(f"*{REPLY_SUFFIX}"))) == 1
    assert want_ids[: len(held)] == held  # the reply as its ids: the first turn reused
    assert runner.tokenizer.decode(want_ids) != _template_text(runner, messages)
    return messages, held, want_ids


def _answer(runner: Runner, prompt, **options) -> tuple:
    chunks = list(runner.stream(prompt, max_tokens=4, temperature=0, logprobs=0, **options))
    return chunks[-1].completion, [c.logprob.logprob for c in chunks if c.logprob]


def test_a_call_reply_sent_back_after_a_restart_takes_its_ids(scripted_path, tmp_path):
    """Seen failing with the record kept by the reply's text (the Turn's key in memory only):
    the restarted prompt rendered the calls from the template."""
    messages, held, want_ids = _first_turn(scripted_path, tmp_path)
    restarted = _runner(scripted_path, tmp_path)
    assert restarted.encode(messages, tools=[WEATHER]) == want_ids
    got, got_logprobs = _answer(restarted, messages, tools=[WEATHER])
    assert got.cached_tokens == len(held)  # the prompt, the reply and its end, from disk
    reference = _runner(scripted_path, None)  # no cache: the model alone, on those ids
    want, want_logprobs = _answer(reference, want_ids)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got_logprobs, want_logprobs, atol=1e-4)


def test_a_call_reply_of_another_salt_renders_from_the_template_after_a_restart(
    scripted_path, tmp_path
):
    messages, _, want_ids = _first_turn(scripted_path, tmp_path)
    restarted = _runner(scripted_path, tmp_path)
    other = restarted.encode(messages, tools=[WEATHER], cache_salt="tenant-b")
    assert restarted.tokenizer.decode(other) == _template_text(restarted, messages)
    assert restarted.encode(messages, tools=[WEATHER]) == want_ids
