"""Two replies whose different ids decode to one text (a sampled non-canonical tokenization,
lone bytes decoding to U+FFFD): the reply memory kept one ids sequence per (salt, text), the
newest, so the same messages rendered to other ids after another conversation's reply than
before it, and the conversation that owned the older ids lost its reuse. Each conversation
renders the ids its own cache holds (`ReplyChoice`), before and after a restart."""

from __future__ import annotations

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.runner.text import replies as replies_module
from mlxkv.runner.text.replies import MAX_CHOICES, ReplyTokens, replies_for, reply_context
from mlxkv.testing.factory import build_model
from tests.runner.test_reply_restart import _runner, scripted_path  # noqa: F401
from tests.runner.test_reply_spacing import COLON_TEMPLATE, _spaced_reply
from tests.runner.test_reply_tokens import ASK, _completion, _next_turn, scripted  # noqa: F401

OTHER_ASK = [{"role": "user", "content": "Say your name twice."}]


def _other_turn(reply: str) -> list[dict]:
    return OTHER_ASK + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Thanks."},
    ]


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
    b_reply = _completion(first.text, b_ids)
    assert replies_for(scripted.tokenizer).remember(b_reply, None, context=reply_context(b_prompt))

    b_turn = _other_turn(first.text)
    assert runner.encode(b_turn)[: len(b_prompt) + len(b_ids)] == b_prompt + b_ids
    assert runner.encode(a_turn) == a_before  # the same messages, the same ids
    a_next = runner.generate(a_turn, max_tokens=1, temperature=0)
    assert a_next.cached_tokens == len(held)
    b_next = runner.generate(b_turn, max_tokens=1, temperature=0)
    assert b_next.cached_tokens >= len(b_prompt) + len(b_ids)


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
    before._pool.store.write_reply(b_prompt, b_ids, first.text, None, reply_context(b_prompt))
    before.close()

    restarted = _runner(scripted_path, tmp_path)
    assert restarted.encode(a_turn) == a_before
    assert restarted.encode(b_turn)[: len(b_prompt) + len(b_ids)] == b_prompt + b_ids
    assert restarted.generate(a_turn, max_tokens=1, temperature=0).cached_tokens == len(held)
    b_next = restarted.generate(b_turn, max_tokens=1, temperature=0)
    assert b_next.cached_tokens >= len(b_prompt) + len(b_ids)


def test_replies_of_one_text_are_chosen_by_context_and_bounded():
    """Each reply of one text is kept with its context, the newest `MAX_CHOICES` of them; a
    render after ids no reply was generated after takes the newest; a restored reply is older
    than those remembered here, and one of a context already known keeps its ids."""
    replies = ReplyTokens()
    prompts = [[7, i] for i in range(MAX_CHOICES + 1)]
    for i, prompt in enumerate(prompts):
        replies.remember(_completion("hi", [100 + i]), None, context=reply_context(prompt))
    choice = replies.known_in([{"role": "assistant", "content": "hi"}], None)["hi"]
    assert choice == [100 + MAX_CHOICES] and len(choice.by_context) == MAX_CHOICES
    kept = range(1, MAX_CHOICES + 1)
    assert [choice.choose(reply_context(prompts[i])) for i in kept] == [[100 + i] for i in kept]
    assert choice.choose(reply_context(prompts[0])) == [100 + MAX_CHOICES]  # the oldest went
    assert choice.choose(reply_context([9])) == [100 + MAX_CHOICES]
    replies.restore([(None, "hi", [1], reply_context(prompts[1])), (None, "new", [2], None)])
    assert [(text, ids) for _, text, ids, _ in replies.items()] == [
        ("new", [2]),
        *(("hi", [100 + i]) for i in range(1, MAX_CHOICES + 1)),
    ]


def test_a_reply_after_the_templates_space_is_chosen_with_its_own_head(tmp_path):
    """A template that writes `Assistant: {content}` after the generation prompt `Assistant:`:
    a reply whose first id holds the space (` never`) renders after the head less that space,
    a newer reply of its text (`n|ever`, another conversation's) after the whole head. Each
    is checked against its own head, so the older keeps its ids. Seen failing with the head
    cut for the newest reply only."""
    template = COLON_TEMPLATE.replace("GENERATION_PROMPT", "Assistant:")
    loaded = load_model(build_model("llama", tmp_path / "m", chat_template=template, seed=5))
    runner = Runner(loaded, max_context=512, cache_entries=4)
    asked, first = _spaced_reply(runner)
    held = runner.cache_tokens
    turn = [*asked, {"role": "assistant", "content": first.text}, {"role": "user", "content": "X"}]
    newer = loaded.tokenizer.encode(first.text, add_special_tokens=False)
    assert newer != first.tokens and loaded.tokenizer.decode(newer) == first.text
    elsewhere = reply_context([5, 6, 7])
    memory = replies_for(loaded.tokenizer)
    assert memory.remember(_completion(first.text, newer), None, context=elsewhere)
    assert runner.encode(turn)[: len(held)] == held


def test_replies_of_one_text_over_the_token_bound_keep_the_newest(monkeypatch):
    """Replies of one text whose ids together pass `MAX_REPLY_TOKENS`: the older go, the one
    just remembered stays (the whole text's replies went, the newest with them)."""
    monkeypatch.setattr(replies_module, "MAX_REPLY_TOKENS", 5)
    replies = ReplyTokens()
    for i in range(2):
        replies.remember(_completion("hi", [i] * 3), None, context=reply_context([i]))
    assert [(text, ids) for _, text, ids, _ in replies.items()] == [("hi", [1, 1, 1])]
