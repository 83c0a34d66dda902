"""Anthropic's `diagnostics.previous_message_id` -> `diagnostics.cache_miss_reason`, through
the real client: null while the cache holds the previous prompt, else the reason in
Anthropic's shape with where the prompt diverged (token, message, block)."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from tests.server.conftest import serve

SYSTEM = "You answer in one word."
FIRST = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Name a fruit."},
]


@pytest.fixture
def served(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=1024)) as served:
        yield served


def _ask(served, messages, previous, system=SYSTEM, stream=False):
    client = served.anthropic()
    options = {
        "model": "m",
        "max_tokens": 2,
        "system": system,
        "messages": messages,
        "extra_body": {"diagnostics": {"previous_message_id": previous}},
    }
    if stream:
        with client.messages.stream(**options) as events:
            return events.get_final_message()
    return client.messages.create(**options)


def _reason(reply) -> dict:
    return reply.diagnostics.cache_miss_reason.model_dump()


def test_null_while_the_cache_holds_the_previous_prompt(served):
    first = _ask(served, FIRST, None)
    assert first.diagnostics is None
    grown = [
        *FIRST,
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Why?"},
    ]
    assert _ask(served, grown, first.id).diagnostics is None
    assert _ask(served, grown, first.id, stream=True).diagnostics is None


def test_an_edited_message_names_the_message_and_the_token(served):
    first = _ask(served, FIRST, None)
    edited = [*FIRST[:2], {"role": "user", "content": "Name a vegetable."}]
    reason = _reason(_ask(served, edited, first.id))
    assert reason["type"] == "messages_changed" and reason["message_index"] == 2
    prompt = served.runner.encode([{"role": "system", "content": SYSTEM}, *FIRST])
    held = reason["diverged_at_token"]
    assert 0 < held < len(prompt)
    assert reason["cache_missed_input_tokens"] == len(prompt) - held


def test_a_changed_block_is_named(served):
    call = {"type": "tool_use", "id": "t1", "name": "look", "input": {}}
    results = [
        {"type": "tool_result", "tool_use_id": "t1", "content": "first result"},
        {"type": "tool_result", "tool_use_id": "t1", "content": "second result"},
    ]
    messages = [
        FIRST[0],
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": results},
    ]
    first = _ask(served, messages, None)
    changed = [*results[:1], {**results[1], "content": "second, edited"}]
    reason = _reason(_ask(served, [*messages[:2], {"role": "user", "content": changed}], first.id))
    assert (reason["message_index"], reason["block_index"]) == (2, 1)


def test_a_changed_system_prompt_streamed(served):
    first = _ask(served, FIRST, None)
    reason = _reason(_ask(served, FIRST, first.id, system="You answer in two words.", stream=True))
    assert reason["type"] == "system_changed" and reason["message_index"] is None


def test_an_unknown_id_and_an_evicted_prompt(served):
    assert _reason(_ask(served, FIRST, "msg_unknown")) == {"type": "previous_message_not_found"}
    first = _ask(served, FIRST, None)
    served.runner.reset()
    reason = _reason(_ask(served, FIRST, first.id))
    assert reason["type"] == "unavailable" and reason["diverged_at_token"] == 0


def test_a_prompt_evicted_to_the_disk_tier_is_still_held(loaded_tiny, tmp_path):
    """One entry in memory: another conversation evicts the first to disk, where the next
    turn finds it (and loads it back), so nothing is missed; an edit is placed after it."""
    runner = Runner(loaded_tiny("llama"), max_context=1024, cache_entries=1, cache_dir=tmp_path)
    with serve(runner) as served:
        first = _ask(served, FIRST, None)
        _ask(served, FIRST, None, system="Another assistant entirely, with other words.")
        runner._pool.store.flush()  # the eviction is written in the background
        prompt = runner.encode([{"role": "system", "content": SYSTEM}, *FIRST])
        assert runner.cached_prefix_tokens(prompt) < len(prompt) // 2  # gone from memory
        grown = [
            *FIRST,
            {"role": "assistant", "content": "Apple."},
            {"role": "user", "content": "Why?"},
        ]
        assert _ask(served, grown, first.id).diagnostics is None
        edited = [*FIRST[:2], {"role": "user", "content": "Name a vegetable."}]
        _ask(served, FIRST, None, system="Another assistant entirely, with other words.")
        runner._pool.store.flush()
        reason = _reason(_ask(served, edited, first.id))
    assert reason["type"] == "messages_changed" and reason["message_index"] == 2
    assert "on disk" in reason["detail"]


def test_no_diagnostics_asked_none_returned(served):
    reply = served.anthropic().messages.create(model="m", max_tokens=2, messages=FIRST)
    assert reply.diagnostics is None


def test_changed_tools_in_the_first_message_are_tools_changed():
    """Templates render tools with the first message, so a miss there with other tools is
    theirs (the tiny template renders no tools, hence a unit test)."""
    import numpy as np

    from mlxkv.server.anthropic_api.diagnostics import PromptRecord, diagnose

    before = PromptRecord(
        tokens=np.arange(10, dtype=np.uint32), system_hash="system", tools_hash="tools-a"
    )
    after = PromptRecord(
        tokens=np.array([0, 1, 2, 9], dtype=np.uint32), system_hash="system", tools_hash="tools-b"
    )
    reason = diagnose(after, before, 3, lambda at: (0, ("system", None)))
    assert reason["type"] == "tools_changed" and reason["cache_missed_input_tokens"] == 1
