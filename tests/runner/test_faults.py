"""Nothing lost, nothing wrong: however a request ends, the entry's tokens equal what the
caches hold, and the next request reuses exactly that and still answers correctly."""

import random
import threading

import pytest

from mlxkv.cache.prefix import common_prefix_length
from tests.factories import fail_layer_update

PROMPT = "<|im_start|>user\nThe quick brown fox jumps over the lazy dog. What next?<|im_end|>\n"


def _assert_consistent(runner):
    entry = runner._pool.latest.cache
    held = runner.cache_tokens
    assert runner.cache_info().num_tokens == len(held)
    offsets = {layer.offset for layer in entry if hasattr(layer, "offset")}
    assert offsets <= {len(held)}


def _assert_next_request_reuses_exactly(runner, fresh, prompt):
    held = runner.cache_tokens
    want_cached = min(common_prefix_length(held, prompt), len(prompt) - 1)
    if want_cached < len(held):  # layers that cannot trim go back to a checkpoint, or to 0
        want_cached = runner._pool.latest.cache.nearest_restorable(want_cached)
    out = runner.generate(prompt, max_tokens=5)
    assert out.cached_tokens == want_cached
    assert out.tokens == fresh.generate(prompt, max_tokens=5).tokens


class _Boom(Exception):
    pass


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_interrupt_inside_the_model_at_random_points(
    make_runner, monkeypatch, arch, seed, speculative
):
    runner = make_runner(arch, prefill_step_size=7, speculative=speculative)
    prompt = runner.tokenizer.encode(PROMPT)
    runner.generate(prompt[:10], max_tokens=3)  # something cached to trim or extend
    rng = random.Random(seed)
    # Verifying drafts takes fewer passes: the fault must still fall inside the request.
    fail_at = rng.randrange(1, 12 if speculative is None else 6)
    error = rng.choice([KeyboardInterrupt, _Boom])
    fail_layer_update(monkeypatch, fail_at, error)
    with pytest.raises(error):
        runner.generate(prompt, max_tokens=8)
    monkeypatch.undo()
    _assert_consistent(runner)
    _assert_next_request_reuses_exactly(runner, make_runner(arch), prompt + prompt[:4])


@pytest.mark.parametrize("stop_after", [0, 1, 3])
def test_leaving_stream_early_keeps_what_was_fed(make_runner, stop_after):
    runner = make_runner("llama")
    prompt = runner.tokenizer.encode(PROMPT)
    seen = []
    for chunk in runner.stream(prompt, max_tokens=10):
        seen.append(chunk.token)
        if len(seen) > stop_after:
            break
    _assert_consistent(runner)
    held = runner.cache_tokens
    assert held[: len(prompt)] == prompt
    assert held[len(prompt) :] == seen[: len(held) - len(prompt)]
    _assert_next_request_reuses_exactly(runner, make_runner("llama"), prompt + seen)


def test_exception_in_progress_callback_during_prefill(make_runner):
    runner = make_runner("gemma3_text", prefill_step_size=5)
    prompt = runner.tokenizer.encode(PROMPT)

    def progress(done, total):
        if done >= 10:
            raise _Boom

    with pytest.raises(_Boom):
        runner.generate(prompt, max_tokens=4, progress=progress)
    _assert_consistent(runner)
    assert runner.cache_tokens == prompt[:10]
    out = runner.generate(prompt, max_tokens=4)
    assert out.cached_tokens == 10
    assert out.tokens == make_runner("gemma3_text").generate(prompt, max_tokens=4).tokens


def test_cancel_from_another_thread_ends_with_cancelled(make_runner):
    runner = make_runner("llama")
    chunks = []
    for chunk in runner.stream(PROMPT, max_tokens=50):
        chunks.append(chunk)
        if len(chunks) == 2:  # joined: the cancel lands before the next chunk is asked for
            caller = threading.Thread(target=runner.cancel)
            caller.start()
            caller.join()
    assert chunks[-1].finish_reason == "cancelled"
    assert chunks[-1].completion.generation_tokens < 50
    _assert_consistent(runner)


def test_concurrent_calls_equal_sequential(make_runner):
    prompts = [f"<|im_start|>user\nQuestion {i}: capital of France?<|im_end|>\n" for i in range(4)]
    sequential = make_runner("llama")
    want = {p: sequential.generate(p, max_tokens=6).tokens for p in prompts}
    shared = make_runner("llama")
    got, errors = {}, []

    def worker(prompt):
        try:
            for _ in range(2):
                got[prompt] = shared.generate(prompt, max_tokens=6).tokens
        except Exception as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert got == want
    _assert_consistent(shared)
