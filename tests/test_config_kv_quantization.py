"""`kv_bits` and `kv_group_size` are checked when a `RunnerConfig` is made, naming the values
quantized K/V takes: `kv_bits=3` passed the config and failed only once a model had loaded
and its first cache was built; 4.0 or True passed as 4 and 1."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.cache.layers.quantized import QuantizedKVCache
from mlxkv.cli import main
from mlxkv.config import KV_BITS, KV_GROUP_SIZES, RunnerConfig


@pytest.mark.parametrize("bits", [3, 7, 0, -1, 16, "8", 4.0, True], ids=repr)
def test_a_width_quantized_kv_does_not_take_is_refused_naming_the_allowed(bits):
    with pytest.raises(
        ValueError, match=rf"kv_bits={bits!r} is not supported; use one of \(4, 8\)"
    ):
        RunnerConfig(kv_bits=bits)


@pytest.mark.parametrize("group_size", [0, 16, 48, 256, "64", 64.0], ids=repr)
def test_a_group_size_quantized_kv_does_not_take_is_refused_naming_the_allowed(group_size):
    with pytest.raises(ValueError, match=r"use one of \(32, 64, 128\)"):
        RunnerConfig(kv_bits=8, kv_group_size=group_size)


@pytest.mark.parametrize("bits", KV_BITS)
@pytest.mark.parametrize("group_size", KV_GROUP_SIZES)
def test_every_setting_a_config_takes_runs_in_the_quantized_layer(bits, group_size):
    config = RunnerConfig(kv_bits=bits, kv_group_size=group_size)
    layer = QuantizedKVCache(config.kv_group_size, config.kv_bits)
    keys = mx.random.normal((1, 2, 3, 128))  # (B, H, L, D)
    (packed, scales, _), _ = layer.update_and_fetch(keys, keys)
    assert packed.shape[-1] == 128 * bits // 32 and scales.shape[-1] == 128 // group_size


def test_the_cli_shows_a_refused_width_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "-p", "Hi", "--kv-bits", "3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and "invalid choice: 3 (choose from 4, 8)" in err
    assert "Traceback" not in err
