"""The warm-up at load (`RunnerConfig.warmup`): MLX compiles its kernels for each shape class a
request meets before the first request, on scratch caches that no entry sees."""

import dataclasses
import logging

import pytest

from mlxkv.cache.building import make_cache
from mlxkv.cache.model_cache import ModelCache
from mlxkv.cli.common import runner_config
from mlxkv.cli.parser import build_parser
from mlxkv.runner.assembly import _PROBE_PROMPTS
from tests.factories import recorded


@pytest.fixture
def widths_fed(monkeypatch):
    """The token count of every `ModelCache.forward` call, in order."""
    return recorded(monkeypatch, ModelCache, "forward", lambda _cache, _model, ids: len(ids))


def _warm_up_widths(make_runner, widths_fed, **settings) -> list[int]:
    """What a Runner with these settings feeds when made, less what it feeds with no warm-up
    (the one-token probe that measures K/V bytes per token)."""
    make_runner("llama", warmup=False, **settings)
    cold = list(widths_fed)
    runner = make_runner("llama", **settings)
    warm = widths_fed[len(cold) :]
    assert warm[: len(cold)] == cold
    return runner, warm[len(cold) :]


def test_warm_up_feeds_each_shape_class_and_leaves_no_entry(make_runner, widths_fed):
    runner, widths = _warm_up_widths(make_runner, widths_fed, max_context=256, speculative="ngram")
    assert widths == [32, 4, 1]
    assert runner.cache_info().num_tokens == 0
    out = runner.generate("one two three four", max_tokens=2, temperature=0)
    assert out.cached_tokens == 0  # the warm-up's tokens are not a prefix anyone can hit


def test_warm_up_covers_the_draft_model(make_runner, loaded_tiny, widths_fed):
    draft = dataclasses.replace(loaded_tiny("llama"))
    _, widths = _warm_up_widths(make_runner, widths_fed, max_context=256, draft=draft)
    assert widths == [32, 4, 1] * 2


TOGETHER = [[0, 0, 0], [0, 0]]
PROBE = _PROBE_PROMPTS


@pytest.mark.parametrize(
    ("arch", "settings", "expected"),
    [
        ("llama", {}, ([TOGETHER], [2])),
        ("llama", {"max_batch": 1}, ([], [])),
        ("gemma3_text", {}, ([TOGETHER], [2])),  # windows: checkpoints sliced from the rows
        # recurrent state: together in the probe that decides it, alone in the warm-up
        ("lfm2", {}, ([list(PROBE)], [2])),
    ],
    ids=["batching", "max-batch-1", "sliding-window", "recurrent"],
)
def test_warm_up_runs_the_batched_path_where_requests_batch(
    make_runner, monkeypatch, arch, settings, expected
):
    """Prompts prefilled together (of different lengths; where the cache's layers may be) and
    a batched decode step of them, on scratch caches: kernels only concurrent requests use
    compile at load too (on a GPU, the first round of batched streams ran at a quarter of the
    next one's rate)."""
    from mlxkv.decoding.batch import DecodeBatch
    from mlxkv.runner import assembly

    prompts = recorded(monkeypatch, assembly, "prefill_together", lambda _m, _c, p, **_: list(p))
    steps = recorded(monkeypatch, DecodeBatch, "_step", lambda batch: batch.num_rows)
    runner = make_runner(arch, max_context=256, **settings)
    assert (prompts, steps) == expected
    assert runner.cache_info().num_tokens == 0
    out = runner.generate("one two three four", max_tokens=2, temperature=0)
    assert out.cached_tokens == 0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["generate", "-p", "x"], True),
        (["generate", "-p", "x", "--no-warmup"], False),
        (["serve", "--no-warmup"], False),
    ],
    ids=["generate", "generate-no-warmup", "serve-no-warmup"],
)
def test_cli_warmup_option(argv, expected):
    assert runner_config(build_parser().parse_args(argv)).warmup is expected


@pytest.mark.parametrize(
    ("arch", "exact"),
    [("lfm2", True), ("mamba", False), ("llama", None)],
    ids=["reads-lengths", "reads-padding", "no-state"],
)
def test_the_probe_at_load_decides_whether_state_is_prefilled_together(
    make_runner, caplog, arch, exact
):
    """LFM2 stops its state before a row's padding (it reads `ArraysCache.lengths`), Mamba
    does not (its state takes the padding in): the probe at load tells them apart, says so in
    the log, and the prefill group admits their caches accordingly. A model with no state
    needs no probe. Warm-up off: the probe decides whatever the warm-up does."""
    with caplog.at_level(logging.INFO, logger="mlxkv.runner.assembly"):
        runner = make_runner(arch, max_context=256, warmup=False)
    lines = [r.getMessage() for r in caplog.records if "prefill probe" in r.getMessage()]
    group = runner._dispatch._batching.prefills
    if exact is None:
        assert lines == [] and group.admits(make_cache(runner.loaded.model), [1, 2])
        return
    assert len(lines) == 1 and f"state_exact={exact}" in lines[0], lines
    assert ("together" if exact else "alone") in lines[0]
    assert group.admits(make_cache(runner.loaded.model), [1, 2]) is exact
