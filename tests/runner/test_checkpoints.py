"""Checkpoints for layers that cannot trim: a recurrent or hybrid model's chat comes back to the
end of the previous prompt instead of reprocessing everything."""

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
