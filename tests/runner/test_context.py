"""The context window: prompts cut to fit, generation that shifts the cache, and the RoPE
re-rotation that makes a shift exact where it can be."""

import logging

import mlx.core as mx
import pytest
from mlx_lm import load

from mlxkv import ContextLengthError, Runner
from mlxkv.cache import make_cache
from mlxkv.models.loading import load_model
from mlxkv.models.rope import rope_rotations
from mlxkv.runner.context import chat_cut, choose_cut
from mlxkv.runner.hooks import request_ends
from mlxkv.testing.factory import build_model
from tests.tolerances import assert_logits_close

ONE_LAYER_ROPES = {
    "llama": {},
    "llama-traditional": {"rope_traditional": True},
    "llama-linear": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "llama3-scaling": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "qwen3": {},
}


@pytest.mark.parametrize("variant", ONE_LAYER_ROPES)
def test_shift_equals_fresh_prefill_of_kept_tokens_on_one_layer(model_root, variant):
    """With one layer, K/V depend only on token and position, so a shifted cache must equal a
    fresh prefill of the kept tokens: this checks the re-rotation exactly."""
    arch = variant.split("-")[0].replace("llama3", "llama")
    overrides = {"num_hidden_layers": 1, **ONE_LAYER_ROPES[variant]}
    path = build_model(arch, f"{model_root}/one-layer-{variant}", config_overrides=overrides)
    model, _ = load(str(path))
    ids = [(7 * i + 3) % 500 for i in range(40)]
    cache = make_cache(model)
    cache.forward(model, ids[:30])
    rotations = rope_rotations(model)
    assert cache.can_shift(rotations)
    cache.shift(4, 11, rotations)
    kept = ids[:4] + ids[15:30]
    assert cache.tokens == kept
    got = cache.forward(model, ids[30:33])[0]
    want = model(mx.array(kept + ids[30:33])[None])[0, -3:]
    assert_logits_close(got, want)


def test_latent_attention_is_not_shifted(model_root):
    """MLA caches the latent as keys and the rotated key part as values: re-rotating the keys
    corrupted a shift (logits 9.2 off a fresh prefill of the kept tokens, one layer)."""
    overrides = {"num_hidden_layers": 1, "first_k_dense_replace": 1}
    path = build_model("deepseek_v3", f"{model_root}/one-layer-mla", config_overrides=overrides)
    model, _ = load(str(path))
    cache = make_cache(model)
    cache.forward(model, list(range(3, 33)))
    assert not cache.can_shift(rope_rotations(model))


def test_unknown_rope_is_not_claimed(load_tiny):
    model, _ = load_tiny("lfm2")  # convolution layers have no RoPE
    assert not make_cache(model).can_shift(rope_rotations(model))


# afm7 and gemma3n: KV-shared layers read another layer's cache; they refill to shift.
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2", "mamba", "afm7", "gemma3n"])
def test_generation_past_the_window_shifts_and_keeps_going(make_runner, arch, caplog):
    runner = make_runner(arch, max_context=40)
    prompt = [(5 * i + 11) % 500 for i in range(30)]
    with caplog.at_level(logging.INFO, logger="mlxkv"):
        out = runner.generate(prompt, max_tokens=40)
    shifts = [r.getMessage() for r in caplog.records if "context shift" in r.getMessage()]
    assert shifts, "no shift logged"
    if arch == "llama":
        assert "reprocessing" not in shifts[0]
    else:
        assert "reprocessing" in shifts[0]
    assert out.generation_tokens == 40 or out.finish_reason == "stop"
    held = runner.cache_tokens
    assert len(held) <= 40 and held[:4] == prompt[:4]
    assert runner.cache_info().num_tokens == len(held)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_twenty_turn_chat_in_a_small_window(make_runner, arch):
    runner = make_runner(arch, max_context=256)
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for turn in range(20):
        messages.append({"role": "user", "content": f"Turn {turn}: the quick brown fox?"})
        out = runner.generate(messages, max_tokens=24)
        messages.append({"role": "assistant", "content": out.text})
        assert runner.cache_info().num_tokens <= 256
    system = runner.encode(messages[:1])[:5]
    assert runner.cache_tokens[:5] == system  # the system prompt survived every cut


def test_long_prompt_keeps_its_first_tokens(make_runner, loaded_tiny, caplog):
    runner = make_runner("llama", max_context=32)
    prompt = [(3 * i + 1) % 500 for i in range(50)]
    with caplog.at_level(logging.INFO, logger="mlxkv"):
        out = runner.generate(prompt, max_tokens=4)
    assert any("dropped 22 tokens after the first 4" in r.getMessage() for r in caplog.records)
    fitted = prompt[:4] + prompt[-24:]  # 32 - 4 tokens of room to answer
    assert out.prompt_tokens == 28
    assert runner.cache_tokens[:28] == fitted
    unlimited = Runner(loaded_tiny("llama")).generate(fitted, max_tokens=4)
    assert out.tokens == unlimited.tokens


def test_long_chat_drops_whole_old_messages_and_keeps_the_cut(make_runner):
    """Whole messages go, the system prompt stays; with nothing cached the cut goes to half the
    budget, so the next turns keep the same start and reuse the cache."""
    runner = make_runner("llama", max_context=120)
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(12):
        messages += [
            {"role": "user", "content": f"Question {i} about the weather in Paris?"},
            {"role": "assistant", "content": f"Answer {i}: it is sunny."},
        ]
    messages.append({"role": "user", "content": "And tomorrow?"})
    out = runner.generate(messages, max_tokens=8)
    budget = 120 - 8
    cuts = {
        first: runner.encode(messages[:1] + messages[first:]) for first in range(1, len(messages))
    }
    first = next(f for f, ids in cuts.items() if len(ids) <= budget // 2)
    assert runner.cache_tokens[: len(cuts[first])] == cuts[first]
    assert out.prompt_tokens == len(cuts[first])
    messages += [
        {"role": "assistant", "content": out.text},
        {"role": "user", "content": "And the day after?"},
    ]
    again = runner.generate(messages, max_tokens=8)
    assert again.cached_tokens >= len(cuts[first]) - 1  # same cut: the whole prompt reused


def test_keep_that_leaves_no_room_is_a_clear_error(make_runner):
    runner = make_runner("llama", max_context=16, keep=20)
    with pytest.raises(ContextLengthError, match="keep is 20 tokens"):
        runner.generate(list(range(30)), max_tokens=4)


def test_default_context_is_the_models_own(loaded_tiny):
    assert Runner(loaded_tiny("llama")).max_context == 4096  # the factory config's maximum


@pytest.mark.parametrize(("diverge_at", "reused"), [(22, 22), (21, 19), (10, 0)])
def test_sliding_window_reuse_only_when_the_window_still_holds_it(model_root, diverge_at, reused):
    """Window of 16 tokens. After a 20-token prompt and 3 fed decode steps the window layers
    hold positions 7..22. Going back to 22 needs 7..21: held, so it trims. Going back to 21
    needs 6..20: position 6 is gone, so it restores the checkpoint taken while prefilling (at
    19, the prompt's last token). Going back to 10 has neither: it reprocesses."""
    path = build_model(
        "gemma3_text", f"{model_root}/gemma3-w16", config_overrides={"sliding_window": 16}
    )
    loaded = load_model(path)
    runner = Runner(loaded)
    first = [(11 * i + 5) % 500 for i in range(20)]
    runner.generate(first, max_tokens=4)
    held = runner.cache_tokens
    assert len(held) == 23
    second = held[:diverge_at] + [(13 * i + 7) % 500 for i in range(6)]
    out = runner.generate(second, max_tokens=5)
    assert out.cached_tokens == reused
    assert out.tokens == Runner(loaded).generate(second, max_tokens=5).tokens


def _messages_rendered(runner, monkeypatch):
    """Counts the messages passed to the chat template (its work grows with them)."""
    count = {"messages": 0}
    tokenizer = runner.tokenizer._tokenizer
    real = type(tokenizer).apply_chat_template

    def counting(self, conversation, *args, **kwargs):
        count["messages"] += len(conversation)
        return real(self, conversation, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "apply_chat_template", counting)
    return count


def test_fitting_a_long_chat_renders_linearly_in_its_length(make_runner, monkeypatch):
    """A fully cached request on a long history in a small window used to render the chat
    once per possible cut (quadratic). Count the rendered messages at 100 and 400 turns: a
    linear cost grows 4x, a quadratic one 16x."""
    rendered = {}
    for turns in (100, 400):
        runner = make_runner("llama", max_context=256)
        messages = [{"role": "system", "content": "Be brief."}]
        for i in range(turns):
            messages += [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": f"Answer {i}."},
            ]
        messages.append({"role": "user", "content": "And now?"})
        runner.generate(messages, max_tokens=2)
        count = _messages_rendered(runner, monkeypatch)
        out = runner.generate(messages, max_tokens=2)
        monkeypatch.undo()
        assert out.cached_tokens == out.prompt_tokens - 1  # the same cut, fully reused
        rendered[turns] = count["messages"]
    assert rendered[400] <= 5 * rendered[100], rendered


def test_default_window_is_what_the_cache_budget_holds_and_a_larger_one_is_warned(
    make_runner, caplog
):
    """One memory reading for the window and the entries' budget: by default the window fits
    `cache_bytes`; a window set beyond it works, with a warning saying what is kept."""
    unbounded = make_runner("llama")
    budget = 64 * 1024
    runner = make_runner("llama", cache_bytes=budget)
    assert runner.max_context < unbounded.max_context
    with caplog.at_level("WARNING", logger="mlxkv.runner.assembly"):
        make_runner("llama", cache_bytes=budget, max_context=runner.max_context * 4)
    assert "raise cache_bytes or lower max_context" in caplog.text


def test_a_shifted_entry_extended_in_the_batch_stays_marked_shifted(loaded_tiny):
    """A turn that goes on from an entry shifted in place, decoded in the batch (whose rows are
    handed back with `adopt`), still holds the K/V the shift approximated: the entry stays
    `shifted` (else `tests/invariants.py` would hold it to a fresh prefill it cannot equal)."""
    runner = Runner(loaded_tiny("llama"), max_context=64, max_batch=2)
    no_eos = {0: -100.0, 1: -100.0, 2: -100.0}
    runner.generate(list(range(3, 43)), max_tokens=40, logit_bias=no_eos)
    ends = []
    with request_ends(ends.append):
        prompt = runner.cache_tokens + [7, 8]  # goes on from it all: shifted K/V reused
        list(runner.stream(prompt, batched=True, speculative=None, max_tokens=3))
    (end,) = ends
    assert end.entry.cache.tokens[: len(prompt)] == prompt and end.entry.cache.shifted


def test_a_cut_another_chat_shares_a_message_with_does_not_hide_this_chats_own():
    """Cut starts come from every entry (and evicted ones): another chat's cut at an equal
    message ("continue"), listed first, must not hide the cut this chat's cache holds."""
    system = [{"role": "system", "content": "S"}]
    chat = [
        *system,
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a" * 40},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "b" * 40},
        {"role": "user", "content": "continue"},
        {"role": "assistant", "content": "c" * 40},
        {"role": "user", "content": "q4"},
    ]

    def render(messages):  # a token a character
        return [ord(c) for m in messages for c in m["content"]]

    held = render(system + chat[3:])  # this chat's entry: cut at "q2"
    cached = lambda ids: len(held) if ids[: len(held)] == held else 0  # noqa: E731
    for starts in ([chat[3]], [chat[5], chat[3]]):
        first, ids = choose_cut(chat_cut(chat, system, render, starts), 100, cached, 200)
        assert (first, cached(ids)) == (3, len(held)), [s["content"] for s in starts]
