"""Review: the default decode batch's row (`default_max_batch`: K/V of the layers that trim back
per token, a state layer or a window's slots once) against what a row of the decode batch
holds (`BatchedKV.merged` of caches each holding a whole context), for sliding windows, mixed
windows and state, and quantized K/V; not the sweep's K/V and state models of
tests/runner/test_max_batch.py."""

from __future__ import annotations

import pytest

from mlxkv.cache.batched import BatchedKV
from mlxkv.config import RunnerConfig
from mlxkv.decoding.prefill.chunks import PrefillPlan, fill
from mlxkv.models.loading import load_model
from mlxkv.runner.assembly import make_layers, measure_one_token
from mlxkv.testing.factory import build_model

WINDOW_TOKENS = 96
CASES = [  # (architecture, K/V bits)
    ("gemma3_text", None),
    ("gemma3_text", 8),
    ("spark2_5", None),
    ("gpt_oss", None),
    ("baichuan_m1", None),  # windows beside state and K/V
    ("recurrent_gemma", None),
    ("llama", 4),
]


@pytest.mark.parametrize(("arch", "bits"), CASES)
def test_a_row_is_what_a_batch_row_holding_the_window_holds(tmp_path, arch, bits):
    overrides = {"head_dim": 32} if bits else None
    model = load_model(build_model(arch, tmp_path / arch, config_overrides=overrides)).model
    config = RunnerConfig(kv_bits=bits, kv_group_size=32) if bits else RunnerConfig()
    _, cost = measure_one_token(model, make_layers(model, config))
    full = []
    for row in range(2):
        cache = make_layers(model, config)
        fill(model, cache, list(range(10 + row, 10 + row + WINDOW_TOKENS)), PrefillPlan(512))
        full.append(cache)
    held = BatchedKV.merged(full).nbytes // 2
    assert WINDOW_TOKENS * cost.kv_bytes_per_token + cost.snapshot_bytes == held
