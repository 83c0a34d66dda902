"""Speculative decoding: greedy output equals plain decoding (a fresh Runner with speculation
off), the cache after it is what the rule says, and sampling keeps the model's distribution
(chi-square tests that are shown to reject a broken rule)."""

from __future__ import annotations

import collections
import dataclasses

import mlx.core as mx
import pytest
from scipy.stats import chi2_contingency, chisquare

from mlxkv import Runner
from mlxkv.cache.building import make_cache
from mlxkv.cache.prefix import common_prefix_length
from mlxkv.decoding import speculative
from mlxkv.decoding.drafts import Draft
from mlxkv.decoding.prefill.chunks import PrefillPlan, fill
from mlxkv.decoding.speculative import AcceptanceRule
from mlxkv.models.loading import load_model
from mlxkv.runner import request_run
from mlxkv.testing.factory import build_model, build_scripted_model
from tests.tolerances import assert_logits_close

ARCHS = ["llama", "qwen3", "gemma3_text", "lfm2"]
PROMPT = "one two three four five six seven eight nine ten. " * 6
RECITED = tuple(f"w{i:02d}" for i in range(24))
SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory):
    """A llama with other random weights and the same tokenizer: a draft it rarely agrees with."""
    return load_model(build_model("llama", tmp_path_factory.mktemp("other") / "m", seed=7))


def _plain(loaded, prompt, **options):
    return Runner(loaded, max_context=1024, speculative=None).generate(prompt, **options)


def _same_model_draft(loaded):
    """The model as its own draft model: every greedy draft is what the model picks."""
    return dataclasses.replace(loaded)


@pytest.fixture(scope="module")
def reciting(tmp_path_factory):
    """A llama that answers any chat with RECITED (24 tokens, then EOS) when greedy: a reply
    that quotes the prompt, so n-gram lookup finds drafts in it as it would in an edit."""
    path = build_scripted_model(tmp_path_factory.mktemp("recite") / "m", RECITED)
    return load_model(path)


def test_greedy_ngram_drafts_from_a_quoted_prompt_and_keeps_the_output(reciting):
    chat = [{"role": "user", "content": "Say it back: " + "".join(RECITED)}]
    expected = _plain(reciting, chat, max_tokens=40)
    assert expected.text == "".join(RECITED)
    runner = Runner(reciting, max_context=1024)
    out = runner.generate(chat, max_tokens=40, speculative="ngram")
    assert out.tokens == expected.tokens and out.text == expected.text
    assert out.accepted_tokens >= len(RECITED) // 2


class _OracleDrafter:
    """Drafts the plain output's next tokens with every third draft token wrong: partial
    acceptance and rollback at every verification, on any model."""

    def __init__(self, prompt, future):
        self._text = list(prompt)
        self._whole = list(prompt) + list(future)

    def extend(self, tokens):
        self._text.extend(tokens)

    def can_propose(self):
        return len(self._text) < len(self._whole)

    def propose(self, limit):
        start = len(self._text)
        truth = self._whole[start : start + limit]
        return Draft([t + 1 if (start + i) % 3 == 0 else t for i, t in enumerate(truth)])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_equals_plain_decoding_when_drafts_are_partly_wrong(
    loaded_tiny, arch, monkeypatch
):
    loaded = loaded_tiny(arch)
    expected = _plain(loaded, PROMPT, max_tokens=40)
    prompt = Runner(loaded).encode(PROMPT)
    monkeypatch.setattr(
        request_run,
        "NgramDrafter",
        lambda tokens, vocab_size: _OracleDrafter(prompt, expected.tokens),
    )
    runner = Runner(loaded, max_context=1024)
    out = runner.generate(PROMPT, max_tokens=40, speculative="ngram")
    assert out.tokens == expected.tokens
    assert 0 < out.accepted_tokens < out.drafted_tokens
    _assert_cache_continues_like_a_fresh_runner(runner, loaded)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_the_model_as_draft_accepts_every_draft(loaded_tiny, arch):
    loaded = loaded_tiny(arch)
    expected = _plain(loaded, PROMPT, max_tokens=30)
    runner = Runner(loaded, max_context=1024, draft=_same_model_draft(loaded))
    out = runner.generate(PROMPT, max_tokens=30, speculative="draft")
    assert out.tokens == expected.tokens
    assert out.drafted_tokens >= 20 and out.accepted_tokens == out.drafted_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_an_unrelated_draft_model_accepts_almost_none(loaded_tiny, arch, tmp_path):
    loaded = loaded_tiny(arch)
    other = load_model(build_model(arch, tmp_path / "other", seed=7))  # same tokenizer
    expected = _plain(loaded, PROMPT, max_tokens=30)
    runner = Runner(loaded, max_context=1024, draft=other)
    out = runner.generate(PROMPT, max_tokens=30, speculative="draft")
    assert out.tokens == expected.tokens and out.drafted_tokens > 0
    assert _plain(other, PROMPT, max_tokens=30).tokens != expected.tokens
    assert out.accepted_tokens <= out.drafted_tokens // 4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("max_tokens", [2, 7, 13])
def test_max_tokens_inside_an_accepted_draft(loaded_tiny, arch, max_tokens):
    loaded = loaded_tiny(arch)
    expected = _plain(loaded, PROMPT, max_tokens=max_tokens)
    runner = Runner(loaded, max_context=1024, draft=_same_model_draft(loaded))
    out = runner.generate(PROMPT, max_tokens=max_tokens, speculative="draft")
    assert out.tokens == expected.tokens and len(out.tokens) == max_tokens
    _assert_cache_continues_like_a_fresh_runner(runner, loaded)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_stop_string_inside_an_accepted_draft(loaded_tiny, arch):
    loaded = loaded_tiny(arch)
    plain = _plain(loaded, PROMPT, max_tokens=30)
    # A stop string that ends at the 9th generated token: inside a draft of 16 or fewer.
    tokenizer = loaded.tokenizer
    stop = tokenizer.decode(plain.tokens[:9])[-3:]
    expected = _plain(loaded, PROMPT, max_tokens=30, stop=[stop])
    runner = Runner(loaded, max_context=1024, draft=_same_model_draft(loaded))
    out = runner.generate(PROMPT, max_tokens=30, stop=[stop], speculative="draft")
    assert (out.text, out.finish_reason) == (expected.text, "stop")
    assert out.accepted_tokens > 0
    _assert_cache_continues_like_a_fresh_runner(runner, loaded)


def _assert_cache_continues_like_a_fresh_runner(runner: Runner, loaded) -> None:
    """The entry holds token ids whose K/V agree: a follow-up equals a fresh runner's, and
    reuses what the rule says (the common prefix of the entry's tokens and the prompt)."""
    cache = runner._pool.latest.cache
    held = cache.tokens
    # The next token's logits from the entry equal those of the same tokens fed afresh.
    fresh = make_cache(loaded.model)
    fill(loaded.model, fresh, held, PrefillPlan(512))
    probe = [held[-1]]
    expected = fresh.forward(loaded.model, probe)
    assert_logits_close(cache.copy().forward(loaded.model, probe), expected)
    follow_up = held + runner.encode(" and then")
    out = runner.generate(follow_up, max_tokens=8, speculative="ngram")
    assert out.cached_tokens == min(common_prefix_length(held, follow_up), len(follow_up) - 1)
    assert out.tokens == _plain(loaded, follow_up, max_tokens=8).tokens


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_next_turn_reuses_what_plain_decoding_would(loaded_tiny, arch):
    loaded = loaded_tiny(arch)
    chat = [{"role": "user", "content": PROMPT}]
    runs = {}
    for mode in (None, "draft"):
        runner = Runner(loaded, max_context=1024, draft=_same_model_draft(loaded))
        first = runner.generate(chat, max_tokens=24, speculative=mode)
        turn = [*chat, {"role": "assistant", "content": first.text}]
        turn.append({"role": "user", "content": "again: " + PROMPT})
        runs[mode] = (first, runner.generate(turn, max_tokens=24, speculative=mode))
    plain_next, (spec_first, spec_next) = runs[None][1], runs["draft"]
    assert spec_first.drafted_tokens > 0
    assert spec_next.cached_tokens == plain_next.cached_tokens > 0
    assert spec_next.text == plain_next.text


def test_cancel_during_speculation_leaves_a_reusable_cache(loaded_tiny):
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, max_context=1024, draft=_same_model_draft(loaded))
    stream = runner.stream(PROMPT, max_tokens=60, speculative="draft")
    for n, _ in enumerate(stream):
        if n == 5:
            runner.cancel()
    assert runner._pool.latest.cache.num_tokens > len(runner.encode(PROMPT))
    _assert_cache_continues_like_a_fresh_runner(runner, loaded)


def test_auto_stops_drafting_when_drafts_do_not_pay(loaded_tiny, other_llama):
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, max_context=1024, draft=other_llama)  # "auto" by default
    out = runner.generate(PROMPT, max_tokens=80)
    forced = runner.generate(PROMPT, max_tokens=80, speculative="draft")
    assert out.tokens == forced.tokens
    assert 0 < out.drafted_tokens < forced.drafted_tokens // 2


def test_bad_modes_and_draft_models_are_refused(loaded_tiny, tmp_path):
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, max_context=1024)
    with pytest.raises(ValueError, match="one of 'auto', 'ngram', 'draft'"):
        runner.stream(PROMPT, speculative="fast")
    with pytest.raises(ValueError, match="needs a draft model"):
        runner.stream(PROMPT, speculative="draft")
    other_vocab = load_model(build_model("llama", tmp_path / "v", vocab_size=400))
    with pytest.raises(ValueError, match="tokenizer"):
        Runner(loaded, draft=other_vocab)


# -- the sampling rule keeps the distribution ---------------------------------------------


def _emitted_tokens(rule: AcceptanceRule, logprobs, q, draws: int) -> list[int]:
    """Tokens the rule emits for drafts drawn from q (None: always token 2, deterministic)."""
    out = []
    for _ in range(draws):
        draft = 2 if q is None else mx.random.categorical(mx.log(q)).item()
        replaced = rule.check(logprobs, draft, q)
        out.append(draft if replaced is None else replaced.item())
    return out


class _AlwaysAccept(AcceptanceRule):
    def check(self, logprobs, token, q):  # a broken rule: every draft goes through
        return None


class _ResampleFromP(AcceptanceRule):
    """A broken rule: a rejection draws from p itself instead of max(p - q, 0)."""

    def check(self, logprobs, token, q):
        if super().check(logprobs, token, q) is None:
            return None
        return mx.random.categorical(logprobs).reshape(1)


@pytest.mark.parametrize("draft_q", ["deterministic", "sampled"])
def test_the_rule_emits_tokens_distributed_as_the_model(draft_q):
    vocab, draws = 8, 4000
    mx.random.seed(3)
    logits = mx.random.normal((1, vocab)) * 1.5
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = mx.softmax(logprobs, axis=-1)[0].tolist()
    q = None if draft_q == "deterministic" else mx.softmax(mx.random.normal((1, vocab)), -1)
    expected = [pi * draws for pi in p]

    def p_value(rule_class) -> float:
        rule = rule_class(lambda lp: mx.softmax(lp, axis=-1))
        counts = collections.Counter(_emitted_tokens(rule, logprobs, q, draws))
        return chisquare([counts[t] for t in range(vocab)], expected).pvalue

    assert p_value(AcceptanceRule) > SIGNIFICANCE
    assert p_value(_AlwaysAccept) < SIGNIFICANCE  # the test can tell a broken rule
    assert p_value(_ResampleFromP) < SIGNIFICANCE


def _second_tokens(runner: Runner, mode, samples: int) -> collections.Counter:
    """The second generated token (the first that verification decides) over many seeds."""
    counts = collections.Counter()
    for seed in range(samples):
        out = runner.generate(
            PROMPT, max_tokens=3, temperature=1.0, top_k=6, seed=seed, speculative=mode
        )
        assert out.drafted_tokens == (0 if mode is None else 1)  # the draft after token 1
        counts[out.tokens[1]] += 1
    return counts


def test_sampling_with_a_draft_model_keeps_the_distribution(loaded_tiny, other_llama, monkeypatch):
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, max_context=1024, draft=other_llama)
    samples = 600
    plain = _second_tokens(runner, None, samples)

    def p_value(mode) -> float:
        drafted = _second_tokens(runner, mode, samples)
        tokens = sorted(set(plain) | set(drafted))
        table = [[plain[t] for t in tokens], [drafted[t] for t in tokens]]
        return chi2_contingency(table).pvalue

    assert p_value("draft") > SIGNIFICANCE
    monkeypatch.setattr(speculative, "AcceptanceRule", _AlwaysAccept)
    assert p_value("draft") < SIGNIFICANCE  # the same test rejects a broken rule


def test_each_conversation_keeps_its_own_draft_cache_counted_in_the_budget(loaded_tiny):
    """The draft model's cache lives on each conversation's entry: interleaved conversations
    do not re-prefill each other's (one shared cache did, every turn), its bytes count in
    `cache_info()` and the budget, and it goes with its entry."""
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, max_context=1024, cache_entries=2, draft=_same_model_draft(loaded))
    prompts = [PROMPT, "Completely different words about rivers and museums, at length."]
    for prompt in prompts:
        runner.generate(prompt, max_tokens=12, speculative="draft")
    entries = runner._pool.entries
    drafts = [entry.draft_cache for entry in entries]
    assert all(d is not None for d in drafts) and drafts[0] is not drafts[1]
    for entry in entries:  # each holds its own conversation (less the token drafting feeds)
        held = entry.cache.tokens
        assert entry.draft_cache.tokens == held[: entry.draft_cache.num_tokens]
        assert entry.draft_cache.num_tokens >= len(held) - 17
    info = runner.cache_info()
    draft_bytes = sum(e.draft_bytes for e in info.entries)
    assert draft_bytes > 0 and info.held_bytes >= info.allocated_bytes + draft_bytes
    runner.generate(prompts[0] + " Go on.", max_tokens=4, speculative=None)  # no draft needed
    assert runner._pool.entries[-1].draft_cache is drafts[0]
