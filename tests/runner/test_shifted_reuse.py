"""What a request reuses of an entry an in-place shift approximated (issue 6 recheck): the
K/V past the shift's kept tokens were computed with the dropped tokens in context."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from mlxkv.runner.disk import store as store_module
from mlxkv.runner.hooks import request_ends
from tests.runner.test_batching import _tokens_and_logprobs
from tests.tolerances import LOGPROB_ABS

KEEP_TOKENS = 4
NO_EOS = {0: -100.0, 1: -100.0, 2: -100.0}  # the factory's special tokens


def _shifted_runner(loaded, **options) -> Runner:
    runner = Runner(loaded, max_context=64, keep=KEEP_TOKENS, speculative=None, **options)
    runner.generate(list(range(3, 43)), max_tokens=40, logit_bias=NO_EOS)
    assert runner._pool.latest.cache.exact_tokens == KEEP_TOKENS  # shifted in place
    return runner


def _answers_as_fresh_and_unshifted(runner: Runner, loaded, prompt: list[int]) -> None:
    """`runner` answers `prompt` as a fresh Runner does (log-probabilities), on an entry that
    holds no approximated K/V after it."""
    options = {"max_tokens": 8, "logprobs": 0, "logit_bias": NO_EOS}
    ends = []
    with request_ends(ends.append):
        got = _tokens_and_logprobs(runner.stream(prompt, **options))
    want = _tokens_and_logprobs(Runner(loaded, speculative=None).stream(prompt, **options))
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS)
    assert not ends[0].entry.cache.shifted


@pytest.mark.parametrize("disk", [False, True], ids=["memory", "disk-tier"])
def test_a_prompt_parting_past_the_kept_tokens_reuses_only_the_exact_ones(
    loaded_tiny, tmp_path, disk
):
    loaded = loaded_tiny("llama")
    runner = _shifted_runner(loaded, cache_dir=tmp_path if disk else None)
    if disk:
        runner._pool.store.flush()
    prompt = runner.cache_tokens[: KEEP_TOKENS + 1] + [7, 8, 9, 10]
    _answers_as_fresh_and_unshifted(runner, loaded, prompt)


@pytest.mark.parametrize("disk", [False, True], ids=["memory", "disk-tier"])
def test_an_exact_retry_of_a_shifted_entry_reuses_only_the_exact_tokens(
    loaded_tiny, tmp_path, disk
):
    """A prompt equal to all a shifted entry holds continues nothing: it asks for the reply
    to that text, so it answers as a fresh Runner, in memory and from the disk tier alike
    (memory reused the approximated K/V, the disk tier the kept tokens alone)."""
    loaded = loaded_tiny("llama")
    runner = _shifted_runner(loaded, cache_dir=tmp_path if disk else None)
    held = runner.cache_tokens
    if disk:
        runner._pool.store.flush()
        runner.reset()  # only the disk holds it now
    _answers_as_fresh_and_unshifted(runner, loaded, held)


def test_a_prompt_going_on_from_all_a_shifted_entry_holds_reuses_it_all(loaded_tiny):
    """Continuing the shifted text itself reuses everything (as llama.cpp's shift does)."""
    runner = _shifted_runner(loaded_tiny("llama"))
    held = runner.cache_tokens
    out = runner.generate(held + [7, 8], max_tokens=2, speculative=None)
    assert out.cached_tokens == len(held)


@pytest.mark.parametrize(
    ("parting_at", "read_bytes_per_s"),
    [(32, None), (34, 1e6)],
    ids=["at-a-block-end", "past-a-partial-restore"],
)
def test_a_prompt_parting_from_a_stored_shifted_entry_reuses_only_the_exact_tokens(
    loaded_tiny, tmp_path, monkeypatch, parting_at, read_bytes_per_s
):
    """On the disk tier (16-token blocks), "goes on from all it holds" is judged against the
    whole stored line: a prompt parting where a block ends (its chain stops there), or past
    the blocks a partial restore loads (reading slowly), parts from the shifted text."""
    monkeypatch.setattr(store_module, "BLOCK_TOKENS", 16)
    loaded = loaded_tiny("llama")
    runner = _shifted_runner(loaded, cache_dir=tmp_path)
    held = runner.cache_tokens
    runner._pool.store.flush()
    runner.reset()  # only the disk holds it now
    if read_bytes_per_s is not None:
        runner._pool.prefill_tokens_per_s = 1000.0
        runner._pool.store.read_bytes_per_s = read_bytes_per_s
    prompt = held[:parting_at] + [t for t in (7, 8, 9, 10, 11) if t != held[parting_at]][:4]
    _answers_as_fresh_and_unshifted(runner, loaded, prompt)
