"""The prefill plan by device (`mlxkv.decoding.prefill.chunks.PrefillPlan`): the chunk size,
and when MLX's kept buffers are given back between chunks."""

import mlx.core as mx
import pytest

from mlxkv.cache import make_cache
from mlxkv.decoding.prefill import chunks as prefill
from mlxkv.platform.machine import memory_bytes


@pytest.fixture
def clears(monkeypatch):
    """How many times `mx.clear_cache` ran."""
    calls = []
    monkeypatch.setattr(prefill.mx, "clear_cache", lambda: calls.append(1))
    return calls


def _fill(loaded, plan):
    cache = make_cache(loaded.model)
    prefill.fill(loaded.model, cache, list(range(1, 97)), plan)


def test_buffers_kept_below_the_threshold(loaded_tiny, clears):
    _fill(loaded_tiny("llama"), prefill.PrefillPlan(32, 1, kept_buffers_bytes=1 << 40))
    assert clears == []


def test_buffers_given_back_over_the_threshold(loaded_tiny, clears):
    _fill(loaded_tiny("llama"), prefill.PrefillPlan(32, 1, kept_buffers_bytes=-1))
    assert len(clears) == 3  # one per chunk


def test_default_plan_keeps_a_share_of_memory():
    plan = prefill.PrefillPlan.make()
    assert plan.kept_buffers_bytes == int(memory_bytes() * prefill.KEPT_BUFFERS_MEMORY_FRACTION)


@pytest.mark.cpu_only
def test_cpu_plan():
    assert prefill.PrefillPlan.make().step_tokens == prefill.DEFAULT_STEP_TOKENS_CPU


@pytest.mark.gpu
def test_gpu_plan():
    plan = prefill.PrefillPlan.make()
    assert (plan.step_tokens, plan.lanes) == (prefill.DEFAULT_STEP_TOKENS_GPU, 1)
    assert mx.default_device() == mx.gpu
