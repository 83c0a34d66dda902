"""A reply the memory dropped (`MAX_REPLIES`) renders the same in the process that generated it
and in a restarted one: both take its ids from its record on disk. Before, the first rendered
it from its text and the restart from the record, so the restart's next turn stopped reusing
its cache at that reply (lfm2: 320 of 430 tokens)."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.runner import assembly
from mlxkv.runner.text import replies as reply_memory
from tests.factories import tiny_model_dir

SYSTEM = "You are a helpful assistant. Answer briefly."


def _runner(arch: str, model_root: str, cache_dir) -> Runner:
    """A Runner of a model loaded afresh: its tokenizer, and so its reply memory, is new, as
    in a restarted process."""
    loaded = load_model(tiny_model_dir(arch, model_root))
    return Runner(loaded, max_context=1024, cache_entries=4, cache_dir=cache_dir)


@pytest.mark.parametrize("restart_slots", [1, 256], ids=["restart-1-slot", "restart-256-slots"])
@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_reply_the_memory_dropped_renders_alike_after_a_restart(
    model_root, tmp_path, monkeypatch, arch, restart_slots
):
    """The first process's memory holds 1 reply; the restarted one's 1 too, or 256 (the
    first one's were taken by other conversations: the restart finds every record)."""
    monkeypatch.setattr(reply_memory, "MAX_REPLIES", 1)
    monkeypatch.setattr(assembly, "MAX_REPLIES", 1)
    before = _runner(arch, model_root, tmp_path)
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question {turn}: a river in Europe?"})
        out = before.generate(messages, max_tokens=12, temperature=0)
        messages.append({"role": "assistant", "content": out.text})
    held = before.cache_tokens  # the last turn's prompt and reply, as this process fed them
    next_turn = [*messages, {"role": "user", "content": "And a museum?"}]
    rendered = before.encode(next_turn)
    before.close()

    monkeypatch.setattr(reply_memory, "MAX_REPLIES", restart_slots)
    monkeypatch.setattr(assembly, "MAX_REPLIES", restart_slots)
    after = _runner(arch, model_root, tmp_path)
    assert after.encode(next_turn) == rendered
    assert rendered[: len(held)] == held  # every reply as its ids, the dropped ones too
    got = after.generate(next_turn, max_tokens=4)
    assert got.cached_tokens == len(held)
    after.close()
