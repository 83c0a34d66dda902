"""The growing-chat benchmark (`python -m benchmarks.run`, issue 5) runs on a fresh Runner: the
floor (d) of its first turn is measured before the runner holds any entry. It crashed there
once the pool stopped keeping an empty entry, and no test ran it; a tiny model makes it cheap."""

from __future__ import annotations

from benchmarks import chat


def test_growing_chat_measures_every_turn_from_a_fresh_runner(loaded_tiny):
    result = chat.measure(
        loaded_tiny("llama"), turns=2, reply_tokens=4, conversations=1, fresh_turns={2}
    )
    first, second = result["turns"]
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] > 0  # the second turn reuses the first
    for row in (first, second):
        assert {"d_floor_s", "b_lru_s", "c_mlxkv_s"} <= row.keys()
    assert "a_fresh_s" in second
