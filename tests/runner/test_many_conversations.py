"""Several conversations interleaved on one Runner with several entries: every answer equals a
fresh runner's, every turn comes back to its own conversation, the budget holds after every
request, and faults leave every entry consistent."""

from __future__ import annotations

import random

import pytest

from mlxkv.cache.prefix import common_prefix_length
from tests.factories import fail_layer_update

SYSTEM = "You are a helpful assistant. Answer briefly and name one river and one museum."
QUESTIONS = ["What is the capital of France?", "And of Italy?", "And of Spain?"]


def _conversation_so_far(runner, messages) -> int:
    """Tokens of the messages before the last reply, as the template renders them: what the
    next turn of this conversation must find in the cache at least. (The reply itself may
    render back otherwise: a random model's text is not always valid UTF-8.)"""
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return len(runner.tokenizer.apply_chat_template(messages, add_generation_prompt=False))


def _check_pool(runner) -> None:
    """The Runner's invariant per entry, and the budgets."""
    pool = runner._pool
    for entry in pool.entries:
        held = entry.cache.tokens
        assert entry.tokens.tolist() == held
        offsets = {layer.offset for layer in entry.cache if hasattr(layer, "offset")}
        assert offsets <= {len(held)}
    info = runner.cache_info()
    assert len(info.entries) <= pool.max_entries
    if pool.max_bytes is not None:
        assert info.held_bytes <= pool.max_bytes


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_interleaved_chats_equal_fresh_runners_and_reuse_their_history(make_runner, arch):
    runner = make_runner(arch, cache_entries=6)
    chats = [[{"role": "system", "content": f"{SYSTEM} You are assistant {i}."}] for i in range(3)]
    for turn, question in enumerate(QUESTIONS):
        for i, messages in enumerate(chats):
            before = _conversation_so_far(runner, messages) if turn else 0
            messages.append({"role": "user", "content": f"{question} (chat {i})"})
            out = runner.generate(messages, max_tokens=5)
            fresh = make_runner(arch).generate(messages, max_tokens=5)
            assert out.tokens == fresh.tokens, f"turn {turn} chat {i}"
            assert out.cached_tokens >= before, f"turn {turn} chat {i}: {out}"
            _check_pool(runner)
            messages.append({"role": "assistant", "content": out.text})
            if turn == 0:  # a side request, as chat apps send for a title
                title = messages + [{"role": "user", "content": "A title for this chat?"}]
                side = runner.generate(title, max_tokens=4)
                assert side.tokens == make_runner(arch).generate(title, max_tokens=4).tokens
                assert side.cached_tokens >= _conversation_so_far(runner, messages)
                _check_pool(runner)


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_shared_system_prompt_is_copied_not_recomputed(make_runner, arch):
    runner = make_runner(arch, cache_entries=4)
    system = {"role": "system", "content": SYSTEM}
    france = [system, {"role": "user", "content": "Capital of France?"}]
    peru = [system, {"role": "user", "content": "Capital of Peru?"}]
    first = runner.generate(france, max_tokens=4)
    second = runner.generate(peru, max_tokens=4)
    assert second.tokens == make_runner(arch).generate(peru, max_tokens=4).tokens
    if arch == "llama":  # K/V trims to any token: all the shared tokens
        want = common_prefix_length(runner.encode(france), runner.encode(peru))
    else:  # recurrent state: the checkpoint where the system prompt ends
        want = len(runner.tokenizer.apply_chat_template([system], add_generation_prompt=False))
    assert first.cached_tokens == 0 and second.cached_tokens == want
    assert len(runner.cache_info().entries) == 2  # the first conversation kept its entry
    again = runner.generate(france + [{"role": "user", "content": "Sure?"}], max_tokens=4)
    assert again.cached_tokens >= _conversation_so_far(runner, france)  # still there


def test_one_entry_stays_the_default_and_interleaving_misses(make_runner):
    runner = make_runner("llama")
    a = [{"role": "user", "content": "Capital of France?"}]
    b = [{"role": "user", "content": "Why is the sky blue at noon?"}]
    runner.generate(a, max_tokens=3)
    runner.generate(b, max_tokens=3)
    again = runner.generate(a, max_tokens=3)
    assert len(runner.cache_info().entries) == 1
    assert again.cached_tokens < len(runner.encode(a)) - 1


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_byte_budget_holds_after_every_request(make_runner, arch):
    probe = make_runner(arch)
    probe.generate("The quick brown fox jumps over the lazy dog " * 3, max_tokens=4)
    budget = int(probe.cache_info().allocated_bytes * 2.5)
    runner = make_runner(arch, cache_entries=8, cache_bytes=budget)
    rng = random.Random(0)
    words = ["fox", "dog", "river", "museum", "capital", "seven", "blue"]
    prompts = [" ".join(rng.choices(words, k=rng.randrange(5, 30))) for _ in range(12)]
    for prompt in prompts + prompts[::3]:
        out = runner.generate(prompt, max_tokens=3)
        assert out.tokens == make_runner(arch).generate(prompt, max_tokens=3).tokens
        _check_pool(runner)
    assert runner.cache_info().held_bytes <= budget


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_conversation_over_the_budget_keeps_its_longest_prefix_that_fits(make_runner, arch):
    """An entry alone over `cache_bytes` keeps the prefix that fits (it used to be evicted
    whole: every later turn a full miss), so each turn still reuses the system prompt."""
    system = [{"role": "system", "content": SYSTEM * 3}]
    probe = make_runner(arch)
    probe.generate(system + [{"role": "user", "content": QUESTIONS[0]}], max_tokens=8)
    budget = int(probe.cache_info().allocated_bytes * 1.5)
    runner = make_runner(arch, cache_bytes=budget, max_context=1024)  # a window over budget
    system_tokens = _conversation_so_far(runner, system)
    messages = list(system)
    for turn, question in enumerate(QUESTIONS * 2):
        messages.append({"role": "user", "content": f"{question} Tell me more, in detail."})
        out = runner.generate(messages, max_tokens=24)
        assert out.tokens == make_runner(arch).generate(messages, max_tokens=24).tokens
        if turn:
            assert out.cached_tokens >= system_tokens, f"turn {turn}: {out}"
        _check_pool(runner)
        messages.append({"role": "assistant", "content": out.text})
    held = len(runner.cache_tokens)
    assert system_tokens <= held < out.prompt_tokens, "the conversation never went over the budget"


def _turns_reusing_their_cut(runner, names: str, turns: int) -> tuple[int, int]:
    """Long chats `names` interleaved on `runner` (a window smaller than each): of the turns
    after a chat's first cut, how many reused its whole previous prompt, and how many there
    were. A disk tier's writes end before the next request (turns come seconds apart)."""
    chats = {
        name: [{"role": "system", "content": f"You are assistant {name}. {SYSTEM}"}]
        for name in names
    }
    reused, turns_after_cut = 0, 0
    previous = {}
    for turn in range(turns):
        for name, messages in chats.items():
            messages.append(
                {"role": "user", "content": f"Turn {turn} of chat {name}: {QUESTIONS[turn % 3]}"}
            )
            out = runner.generate(messages, max_tokens=8)
            messages.append({"role": "assistant", "content": out.text})
            if runner._pool.store is not None:  # written between turns, as seconds apart
                runner._pool.store.flush()
            full = len(runner.encode(messages[:-1]))
            if name in previous and full > runner.max_context:
                turns_after_cut += 1
                reused += out.cached_tokens >= previous[name]
            previous[name] = out.prompt_tokens
    return reused, turns_after_cut


def test_two_long_chats_interleaved_in_a_small_window_each_reuse_their_own_cut(make_runner):
    """Each conversation's cut to the window lives on its own entry: interleaved, each turn
    of each still reuses its previous prompt (one cut remembered per Runner made every turn of
    one conversation forget the other's cut: a new cut, and a miss, on every turn)."""
    runner = make_runner("llama", max_context=320, cache_entries=4)
    reused, turns_after_cut = _turns_reusing_their_cut(runner, "ab", turns=12)
    assert turns_after_cut >= 8
    assert reused >= turns_after_cut * 0.6, f"{reused} of {turns_after_cut} turns reused"


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_long_chats_past_the_entry_budget_reuse_their_cut_from_disk(make_runner, tmp_path, arch):
    """Three long chats through two entries (the server's disk tier on): each turn's entry
    goes to disk while the others run, and its cut with it, so the next turn cuts where its
    blocks start and loads them (the cut was kept only on entries in memory: every turn cut
    afresh elsewhere and missed most of the window)."""
    runner = make_runner(arch, max_context=320, cache_entries=2, cache_dir=tmp_path)
    reused, turns_after_cut = _turns_reusing_their_cut(runner, "abc", turns=12)
    assert turns_after_cut >= 12
    assert reused >= turns_after_cut * 0.6, f"{reused} of {turns_after_cut} turns reused"


class _Boom(Exception):
    pass


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
@pytest.mark.parametrize("seed", range(3))
def test_faults_leave_every_entry_consistent(make_runner, monkeypatch, arch, seed):
    runner = make_runner(arch, cache_entries=3, prefill_step_size=7)
    system = {"role": "system", "content": SYSTEM}
    chats = [[system, {"role": "user", "content": q}] for q in QUESTIONS]
    for messages in chats[:2]:
        runner.generate(messages, max_tokens=3)
    rng = random.Random(seed)
    fail_at, error = rng.randrange(1, 12), rng.choice([KeyboardInterrupt, _Boom])
    fail_layer_update(monkeypatch, fail_at, error)
    with pytest.raises(error):
        runner.generate(chats[2], max_tokens=8)  # a copy of the shared system prompt, then more
    monkeypatch.undo()
    _check_pool(runner)
    for messages in chats:  # every conversation still answers as a fresh runner does
        prompt = runner.encode(messages)
        held = [e.cache.tokens for e in runner._pool.entries]
        best = max((min(common_prefix_length(h, prompt), len(prompt) - 1) for h in held), default=0)
        out = runner.generate(messages, max_tokens=4)
        assert out.tokens == make_runner(arch).generate(messages, max_tokens=4).tokens
        assert out.cached_tokens <= best
        if arch == "llama":  # layers that trim reach every token some entry holds
            assert out.cached_tokens == best
        _check_pool(runner)


def test_a_deleted_chat_leaves_no_cut_behind(make_runner, tmp_path):
    """A chat its client deleted (`drop_cache_entries`) is dropped, not evicted: its cut, the
    client's message itself, is not kept for later prompts as an evicted chat's is."""
    runner = make_runner("llama", max_context=128, cache_dir=tmp_path)
    messages = [{"role": "system", "content": "sys"}]
    for turn in range(8):
        messages += [
            {"role": "user", "content": f"turn {turn}: {QUESTIONS[turn % 3]}"},
            {"role": "assistant", "content": "ok " * 10},
        ]
    runner.generate([*messages, {"role": "user", "content": "last"}], max_tokens=1, cache_key="a")
    assert runner._pool.cuts.starts(), "the chat was never cut"
    assert runner.drop_cache_entries("a") == 1
    assert runner._pool.cuts.starts() == []
