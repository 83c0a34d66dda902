"""Two replies whose different ids decode to one text (a sampled non-canonical tokenization,
lone bytes decoding to U+FFFD): the reply memory keeps one ids sequence per (salt, text), the
newest, so the same messages render to other ids after another conversation's reply than
before it, and the conversation that owns the older ids loses its reuse (issue 44's open
fault). The fix wanted: render, for each conversation, the ids its own cache holds, the same
before and after a restart (see the branch `replyids` report for the design)."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from mlxkv.runner.text.replies import replies_for
from tests.runner.test_reply_restart import _runner, scripted_path  # noqa: F401
from tests.runner.test_reply_tokens import ASK, _completion, _next_turn, scripted  # noqa: F401

OTHER_ASK = [{"role": "user", "content": "Say your name twice."}]


def _other_turn(reply: str) -> list[dict]:
    return OTHER_ASK + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Thanks."},
    ]


@pytest.mark.xfail(
    strict=True,
    reason="issue 44 open fault: the newest reply's ids stand for a text two replies share",
)
def test_each_conversation_renders_the_ids_its_cache_holds(scripted):  # noqa: F811
    """Conversation A's reply `Sm|ol|LAM|SmolLAM`; conversation B's reply has the same text as
    the canonical `SmolLAM|SmolLAM` (B's cache holds its prompt and those ids: a token prompt
    stands for its generation, as the scripted model only writes A's ids). A's next turn must
    render as it did before B's reply was remembered and reuse A's whole entry; B's next turn
    must render B's ids and reuse B's prompt and reply."""
    runner = Runner(scripted, max_context=512, cache_entries=4)
    first = runner.generate(ASK, max_tokens=20, temperature=0)
    held = runner.cache_tokens
    a_turn = _next_turn(first.text)
    a_before = runner.encode(a_turn)
    assert a_before[: len(held)] == held  # A's ids: the case this test starts from

    b_ids = scripted.tokenizer.encode(first.text, add_special_tokens=False)
    assert b_ids != first.tokens and scripted.tokenizer.decode(b_ids) == first.text
    b_prompt = runner.encode(OTHER_ASK)
    runner.generate(b_prompt + b_ids, max_tokens=1, temperature=0)  # B's entry
    assert replies_for(scripted.tokenizer).remember(_completion(first.text, b_ids), None)

    b_turn = _other_turn(first.text)
    assert runner.encode(b_turn)[: len(b_prompt) + len(b_ids)] == b_prompt + b_ids
    assert runner.encode(a_turn) == a_before  # the same messages, the same ids
    a_next = runner.generate(a_turn, max_tokens=1, temperature=0)
    assert a_next.cached_tokens == len(held)
    b_next = runner.generate(b_turn, max_tokens=1, temperature=0)
    assert b_next.cached_tokens >= len(b_prompt) + len(b_ids)


@pytest.mark.xfail(
    strict=True,
    reason="issue 44 open fault: one disk record per (salt, text), the newest reply's ids",
)
def test_each_conversation_renders_its_ids_after_a_restart(scripted_path, tmp_path):  # noqa: F811
    """The same two conversations with a disk tier, both replies written as the Runner writes
    them (`DiskStore.write_reply` behind their blocks): a restarted process renders each
    conversation's next turn as the process that generated them did before B's reply (A's
    ids for A, B's for B), and reuses each whole turn from disk."""
    before = _runner(scripted_path, tmp_path)
    first = before.generate(ASK, max_tokens=20, temperature=0)
    held = before.cache_tokens
    a_turn, b_turn = _next_turn(first.text), _other_turn(first.text)
    a_before = before.encode(a_turn)
    b_ids = before.tokenizer.encode(first.text, add_special_tokens=False)
    b_prompt = before.encode(OTHER_ASK)
    before.generate(b_prompt + b_ids, max_tokens=1, temperature=0)  # B's entry
    before._pool.store.write_reply(b_prompt, b_ids, first.text, None)
    before.close()

    restarted = _runner(scripted_path, tmp_path)
    assert restarted.encode(a_turn) == a_before
    assert restarted.encode(b_turn)[: len(b_prompt) + len(b_ids)] == b_prompt + b_ids
    assert restarted.generate(a_turn, max_tokens=1, temperature=0).cached_tokens == len(held)
    b_next = restarted.generate(b_turn, max_tokens=1, temperature=0)
    assert b_next.cached_tokens >= len(b_prompt) + len(b_ids)
