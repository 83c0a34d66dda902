"""Multi-turn chats: every turn equals a fresh runner with no cache, token for token, while
cached_tokens equals the common prefix with what the cache held."""

import logging

import pytest

from mlxkv.cache.prefix import common_prefix_length
from mlxkv.testing.factory import ARCHITECTURES

TRIMMABLE = {"llama", "qwen3", "gemma3_text", "spark2_5"}
MAX_TOKENS = 6


def _fed_tokens(prompt: list[int], out, eos: int) -> list[int]:
    """What the spec says the entry holds after a request: the prompt plus the tokens fed back,
    which is every sampled token but the last when generation ran out of max_tokens. A later
    EOS was fed before it was seen (pipelining); a first-token EOS was not."""
    sampled = list(out.tokens)
    if out.finish_reason == "stop" and sampled and len(sampled) < out.generation_tokens:
        sampled.append(eos)
    return prompt + (sampled[:-1] if out.finish_reason == "length" else sampled)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_token_extension_chat_reuses_everything_fed(make_runner, arch):
    runner = make_runner(arch)
    tokenizer = runner.tokenizer
    prompt = tokenizer.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
    entry: list = []
    for turn in range(4):
        out = runner.generate(prompt, max_tokens=MAX_TOKENS)
        fresh = make_runner(arch).generate(prompt, max_tokens=MAX_TOKENS)
        assert out.tokens == fresh.tokens, f"turn {turn}"
        want_cached = min(common_prefix_length(entry, prompt), len(prompt) - 1)
        if arch not in TRIMMABLE and want_cached < len(entry):
            want_cached = 0  # recurrent layers cannot go back: reprocess
        assert out.cached_tokens == want_cached, f"turn {turn}"
        entry = _fed_tokens(prompt, out, next(iter(tokenizer.eos_token_ids)))
        assert runner.cache_tokens == entry
        user = tokenizer.encode(f"<|im_start|>user\nAnd turn {turn}?<|im_end|>\n")
        prompt = prompt + out.tokens + user
    if arch in TRIMMABLE:
        assert out.cached_tokens > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_chat_messages_equal_fresh_runner(make_runner, arch):
    runner = make_runner(arch)
    messages = [{"role": "system", "content": "You are terse."}]
    cached = []
    for question in ("What is the capital of France?", "And Italy?", "And Germany?"):
        messages.append({"role": "user", "content": question})
        out = runner.generate(messages, max_tokens=MAX_TOKENS)
        fresh = make_runner(arch).generate(messages, max_tokens=MAX_TOKENS)
        assert out.tokens == fresh.tokens and out.text == fresh.text
        cached.append(out.cached_tokens)
        messages.append({"role": "assistant", "content": out.text})
    # Each later prompt starts with the whole previous one, so at least that much is reused
    # where layers can trim (the factory's 8-token sliding windows usually cannot go back).
    if arch == "llama":
        assert all(c > 0 for c in cached[1:])


def test_same_prompt_twice_refeeds_one_token(make_runner):
    runner = make_runner("llama")
    prompt = runner.tokenizer.encode("Paris is the capital of France")
    first = runner.generate(prompt, max_tokens=0)
    second = runner.generate(prompt, max_tokens=3)
    assert first.cached_tokens == 0 and first.generation_tokens == 0
    assert second.cached_tokens == len(prompt) - 1
    assert second.tokens == make_runner("llama").generate(prompt, max_tokens=3).tokens


def test_memory_log_line_once_per_generation_matches_cache_info(make_runner, caplog):
    runner = make_runner("gemma3_text")
    with caplog.at_level(logging.INFO, logger="mlxkv"):
        runner.generate("The quick brown fox", max_tokens=4)
        runner.generate("The quick brown fox jumps", max_tokens=4)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv cache:")]
    assert len(lines) == 2
    info = runner.cache_info()
    from mlxkv import format_bytes

    assert lines[-1].startswith(
        f"kv cache: {info.num_tokens} tokens, {format_bytes(info.used_bytes)} in use, "
        f"{format_bytes(info.allocated_bytes)} allocated, peak "
    )
    layers = runner._pool.latest.cache.layers
    assert info.allocated_bytes == sum(layer.nbytes for layer in layers)
    assert info.used_bytes == sum(layer.used_bytes for layer in layers)
