"""Review of the draft model following the target's window (dshift): draft models other than
the target itself (smaller, a sliding window, a recurrent one), the target unable to shift
while the draft can and the reverse, a kept system prompt, quantized K/V, the next turn, a stop
string and a cancel right after a shift. Reference: plain decoding on a fresh Runner without
a draft model; tokens equal, log-probabilities within `LOGPROB_ABS`."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv import Runner
from mlxkv.cache.building import make_cache
from mlxkv.decoding.prefill.chunks import PrefillPlan, fill
from mlxkv.models.loading import load_model
from mlxkv.runner.context import ContextWindow
from mlxkv.testing.factory import build_model
from tests.factories import joined
from tests.tolerances import LOGPROB_ABS

SYSTEM = {"role": "system", "content": "You are brief and count colors."}
QUESTION = {"role": "user", "content": "Count the colors: red blue green red blue green."}
ROOM_TOKENS = 10
MAX_TOKENS = 80
# (target, draft, draft's config overrides): the draft a smaller or other kind of model
CASES = [
    ("llama", "llama", {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}),
    ("llama", "gemma3_text", None),  # the draft cannot shift (window): prefilled again
    ("llama", "lfm2", None),  # recurrent draft
    ("llama", "mamba", None),
    ("gemma3_text", "llama", None),  # the target reprocesses, the draft shifts in place
    ("lfm2", "llama", None),
]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    built = {}

    def get(arch, overrides):
        key = (arch, repr(overrides))
        if key not in built:
            path = tmp_path_factory.mktemp(f"draft-{arch}")
            built[key] = load_model(build_model(arch, path, seed=5, config_overrides=overrides))
        return built[key]

    return get


@pytest.fixture
def shifts(monkeypatch):
    """Counts the times a target window made room."""
    seen = {"rooms": 0}
    make_room = ContextWindow.make_room

    def counted(self, cache, num_new):
        held = cache.num_tokens
        made = make_room(self, cache, num_new)
        seen["rooms"] += cache.num_tokens < held
        return made

    monkeypatch.setattr(ContextWindow, "make_room", counted)
    return seen


def _assert_same(got_chunks, want_chunks):
    got, want = got_chunks[-1].completion, want_chunks[-1].completion
    assert got.tokens == want.tokens
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    assert [c.logprob.logprob for c in got_chunks[:-1]] == pytest.approx(
        [c.logprob.logprob for c in want_chunks[:-1]], abs=LOGPROB_ABS
    )


def _assert_draft_cache_is_its_tokens(runner: Runner, draft) -> None:
    """Every entry's draft cache, unless shifted in place, holds the K/V of its token ids."""
    for entry in runner._pool.entries:
        cache = entry.draft_cache
        if cache is None or cache.num_tokens == 0 or cache.shifted:
            continue
        tokens = cache.tokens
        fresh = make_cache(draft.model)
        fill(draft.model, fresh, tokens, PrefillPlan(512))
        probe = [tokens[-1]]
        copy = cache.copy()
        copy.capacity_tokens = None
        want, got = fresh.forward(draft.model, probe), copy.forward(draft.model, probe)
        mx.eval(want, got)
        diff = mx.abs(want - got).max().item()
        assert diff < 1e-3, f"draft cache differs from its tokens by {diff}"


@pytest.mark.parametrize(("target", "draft_arch", "overrides"), CASES)
@pytest.mark.parametrize("system", [False, True])
def test_other_draft_models_past_the_window_and_the_next_turn_equal_plain(
    loaded_tiny, drafts, shifts, target, draft_arch, overrides, system
):
    loaded, draft = loaded_tiny(target), drafts(draft_arch, overrides)
    messages = [SYSTEM, QUESTION] if system else [QUESTION]
    window = len(Runner(loaded).encode(messages)) + ROOM_TOKENS
    options = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0}
    drafted = Runner(loaded, max_context=window, draft=draft)
    for turn in range(2):
        plain = Runner(loaded, max_context=window, speculative=None)
        want = list(plain.stream(messages, **options))
        shifts["rooms"] = 0
        got = list(drafted.stream(messages, speculative="draft", **options))
        _assert_same(got, want)
        if turn == 0:
            assert shifts["rooms"] >= 1, "too short a reply to shift"
            assert got[-1].completion.drafted_tokens > 0
        _assert_draft_cache_is_its_tokens(drafted, draft)
        reply = want[-1].completion.text
        messages = [*messages, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": "Again, the colors?"})


@pytest.mark.parametrize(("target", "draft_arch", "overrides"), CASES[:2] + CASES[4:5])
def test_a_stop_string_right_after_a_shift_with_a_draft_model_equals_plain(
    loaded_tiny, drafts, target, draft_arch, overrides
):
    loaded, draft = loaded_tiny(target), drafts(draft_arch, overrides)
    window = len(Runner(loaded).encode([QUESTION])) + ROOM_TOKENS
    options = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    full = Runner(loaded, max_context=window, speculative=None).generate([QUESTION], **options)
    tokenizer = loaded.tokenizer
    # a stop string ending a few tokens past the first shift (the reply's ROOM_TOKENS-th)
    for end in range(ROOM_TOKENS + 1, ROOM_TOKENS + 6):
        stop = tokenizer.decode(full.tokens[:end])[-3:]
        if stop.strip() and stop not in tokenizer.decode(full.tokens[: end - 1]):
            break
    else:
        pytest.skip("no stop string found near the shift")
    want = list(
        Runner(loaded, max_context=window, speculative=None).stream(
            [QUESTION], stop=[stop], logprobs=0, **options
        )
    )
    drafted = Runner(loaded, max_context=window, draft=draft)
    got = list(drafted.stream([QUESTION], stop=[stop], speculative="draft", logprobs=0, **options))
    _assert_same(got, want)
    again = drafted.generate([QUESTION], speculative="draft", **options)
    assert again.tokens == full.tokens


@pytest.mark.parametrize(("target", "draft_arch", "overrides"), CASES[:2] + CASES[4:5])
def test_a_cancel_right_after_a_shift_with_a_draft_model_leaves_a_reusable_cache(
    loaded_tiny, drafts, shifts, target, draft_arch, overrides
):
    loaded, draft = loaded_tiny(target), drafts(draft_arch, overrides)
    window = len(Runner(loaded).encode([QUESTION])) + ROOM_TOKENS
    options = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    full = Runner(loaded, max_context=window, speculative=None).generate([QUESTION], **options)
    drafted = Runner(loaded, max_context=window, draft=draft)
    shifts["rooms"] = 0
    stream = drafted.stream([QUESTION], speculative="draft", **options)
    for _ in stream:
        if shifts["rooms"] >= 1:
            break
    stream.close()
    assert shifts["rooms"] >= 1
    again = drafted.generate([QUESTION], speculative="draft", **options)
    assert again.tokens == full.tokens
    _assert_draft_cache_is_its_tokens(drafted, draft)


def test_a_quantized_target_past_the_window_with_a_draft_model_equals_plain(
    loaded_quantizable, shifts
):
    """The target's K/V quantized (it reprocesses), the draft model float (shifts in place)."""
    loaded = loaded_quantizable
    window = len(Runner(loaded).encode([QUESTION])) + ROOM_TOKENS
    options = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0}
    kv = {"kv_bits": 8, "kv_group_size": 64}
    plain = Runner(loaded, max_context=window, speculative=None, **kv)
    want = list(plain.stream([QUESTION], **options))
    shifts["rooms"] = 0
    drafted = Runner(loaded, max_context=window, draft=loaded, **kv)
    got = list(drafted.stream([QUESTION], speculative="draft", **options))
    assert shifts["rooms"] >= 2
    _assert_same(got, want)


@pytest.mark.parametrize(("target", "draft_arch", "overrides"), CASES[:2])
def test_a_shifting_drafted_reply_beside_batched_requests_equals_plain(
    loaded_tiny, drafts, shifts, target, draft_arch, overrides
):
    """max_batch 4: one reply passes the window (alone, drafting, shifting) while two short
    requests with the draft model decode, joining and leaving the batch; each equals plain."""
    import threading

    loaded, draft = loaded_tiny(target), drafts(draft_arch, overrides)
    window = len(Runner(loaded).encode([QUESTION])) + ROOM_TOKENS
    shorts = [
        [{"role": "user", "content": "Paris is the capital of?"}],
        [{"role": "user", "content": "The quick brown fox?"}],
    ]
    jobs = [([QUESTION], MAX_TOKENS * 2), (shorts[0], 12), (shorts[1], 20)]
    plain = Runner(loaded, max_context=window, speculative=None)
    want = [plain.generate(m, max_tokens=n, temperature=0.0).tokens for m, n in jobs]
    runner = Runner(loaded, max_context=window, max_batch=4, cache_entries=8, draft=draft)
    got: list = [None] * len(jobs)

    def run(i):
        messages, n = jobs[i]
        got[i] = runner.generate(messages, max_tokens=n, temperature=0.0, speculative="draft")

    for _ in range(2):  # the second round: every conversation's next identical request
        shifts["rooms"] = 0
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        joined(*threads, timeout_s=120)
        assert [g.tokens for g in got] == want
        assert shifts["rooms"] >= 1


@pytest.mark.parametrize(("target", "draft_arch", "overrides"), CASES)
def test_a_long_kept_system_prompt_shifting_every_few_tokens_equals_plain(
    loaded_tiny, drafts, shifts, target, draft_arch, overrides
):
    """The system prompt (kept) is most of the window: each shift drops a token or two, and
    the draft model follows every one."""
    loaded, draft = loaded_tiny(target), drafts(draft_arch, overrides)
    system = {"role": "system", "content": "You count colors. " * 6}
    messages = [system, {"role": "user", "content": "red blue"}]
    window = len(Runner(loaded).encode(messages)) + 3
    options = {"max_tokens": 48, "temperature": 0.0, "logprobs": 0}
    want = list(Runner(loaded, max_context=window, speculative=None).stream(messages, **options))
    shifts["rooms"] = 0
    drafted = Runner(loaded, max_context=window, draft=draft)
    got = list(drafted.stream(messages, speculative="draft", **options))
    _assert_same(got, want)
    assert shifts["rooms"] >= 1


@pytest.mark.parametrize(("target", "draft_arch", "overrides"), CASES[:2])
def test_a_sampled_auto_reply_past_the_window_with_another_draft_is_seeded(
    loaded_tiny, drafts, target, draft_arch, overrides
):
    loaded, draft = loaded_tiny(target), drafts(draft_arch, overrides)
    window = len(Runner(loaded).encode([QUESTION])) + ROOM_TOKENS
    options = {"max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 3, "logprobs": 2}
    runs = [
        Runner(loaded, max_context=window, draft=draft).generate([QUESTION], **options)
        for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens
    assert all(0 <= t < loaded.vocab_size for t in runs[0].tokens)


@pytest.mark.parametrize(("target", "draft_arch", "overrides"), CASES[:2] + CASES[4:5])
def test_a_shifted_drafted_entry_through_the_disk_tier_answers_as_plain(
    loaded_tiny, drafts, shifts, tmp_path, target, draft_arch, overrides
):
    """A reply past the window with a draft model, the Runner closed (entries written) and a
    new one on the same folder: the same request and the next turn answer as plain."""
    loaded, draft = loaded_tiny(target), drafts(draft_arch, overrides)
    window = len(Runner(loaded).encode([QUESTION])) + ROOM_TOKENS
    options = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    plain = Runner(loaded, max_context=window, speculative=None)
    first = plain.generate([QUESTION], **options)
    turn2 = [
        QUESTION,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Again?"},
    ]
    second = plain.generate(turn2, **options)
    shifts["rooms"] = 0
    runner = Runner(loaded, max_context=window, draft=draft, cache_dir=tmp_path)
    got = runner.generate([QUESTION], speculative="draft", **options)
    assert got.tokens == first.tokens and shifts["rooms"] >= 1
    runner.close()
    again = Runner(loaded, max_context=window, draft=draft, cache_dir=tmp_path)
    assert again.generate([QUESTION], speculative="draft", **options).tokens == first.tokens
    assert again.generate(turn2, speculative="draft", **options).tokens == second.tokens
    again.close()
