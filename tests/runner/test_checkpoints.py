"""Checkpoints for layers that cannot trim: a recurrent or hybrid model's chat comes back to the
end of the previous prompt instead of reprocessing everything."""

import logging

import pytest

from mlxkv.cache.checkpoints import MAX_CHECKPOINTS

SYSTEM = 3 * (
    "You are a helpful assistant. Answer questions about capitals, rivers, museums, weather, "
    "numbers like 1, 2, 3, 42 and 1000, and small pieces of code such as def f(x): return x + 1. "
)


@pytest.mark.parametrize("arch", ["lfm2", "mamba"])
def test_recurrent_chat_reuses_most_of_the_history(make_runner, arch):
    """The app edits each reply before sending it back (as chat apps do when they strip
    thinking), so the history diverges where the reply starts: recurrent state cannot trim back
    there, and only the checkpoint at the end of the previous prompt saves the reprocessing."""
    runner = make_runner(arch)
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(["Capital of France?", "And Italy?", "And Spain?", "Why?"]):
        messages.append({"role": "user", "content": question})
        out = runner.generate(messages, max_tokens=6)
        fresh = make_runner(arch).generate(messages, max_tokens=6)
        assert out.tokens == fresh.tokens, f"turn {turn}"
        if turn:
            assert out.cached_tokens / out.prompt_tokens > 0.8, f"turn {turn}: {out}"
        messages.append({"role": "assistant", "content": f"(edited) {out.text}"})


def test_checkpoint_memory_is_bounded_and_reported(make_runner):
    runner = make_runner("lfm2")
    messages = [{"role": "system", "content": SYSTEM}]
    for question in ["Capital of France?", "And Italy?", "And Spain?", "And Peru?"]:
        messages.append({"role": "user", "content": question})
        out = runner.generate(messages, max_tokens=4)
        messages.append({"role": "assistant", "content": out.text})
    info = runner.cache_info()
    entry = runner._pool.latest.cache
    recurrent = sum(layer.nbytes for layer in entry if not hasattr(layer, "offset"))
    assert 0 < info.checkpoint_bytes <= MAX_CHECKPOINTS * recurrent
    assert "checkpoints" in info.log_line()


def test_attention_only_models_take_no_checkpoints(make_runner):
    runner = make_runner("llama")
    runner.generate([{"role": "user", "content": "Capital of France?"}], max_tokens=4)
    assert runner.cache_info().checkpoint_bytes == 0


@pytest.mark.parametrize("arch", ["gemma3_text", "lfm2"])
@pytest.mark.parametrize("edited", ["second-turn", "first-turn"])
def test_a_partial_match_the_layers_cannot_reach_is_logged_with_why(
    make_runner, caplog, arch, edited
):
    """Issue 3: layers that cannot trim reprocess what a partial match shares past their
    reach, and the log says why: back to a checkpoint (the second turn edited), and also
    with no checkpoint before the edit (the first turn edited), which was a plain miss."""
    runner = make_runner(arch)
    first = {"role": "user", "content": "Tell me about caches and why they matter."}
    messages = [first]
    if edited == "second-turn":
        reply = runner.generate(messages, max_tokens=4).text
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
    runner.generate(messages, max_tokens=4)
    held = runner.cache_tokens
    messages[-1] = {"role": "user", "content": messages[-1]["content"] + " Edited."}
    prompt = runner.encode(messages)
    common = next(i for i, (a, b) in enumerate(zip(held, prompt, strict=False)) if a != b)
    with caplog.at_level(logging.INFO, logger="mlxkv"):
        out = runner.generate(messages, max_tokens=4)
    assert common > 0 and out.cached_tokens < common
    assert f"cannot go back from {len(held)} to {common} tokens" in caplog.text
    assert f"the nearest checkpoint is at {out.cached_tokens}" in caplog.text
