"""The environment variables `mlxkv.config` reads: a bad value is one clear error naming the
variable and what it takes, not a conversion error from deep inside a Runner."""

from __future__ import annotations

import pytest

from mlxkv.config import DEFAULT_RANK_TIMEOUT_S, rank_timeout_s


def test_rank_timeout_is_the_default_when_unset_or_empty(monkeypatch):
    monkeypatch.delenv("MLXKV_RANK_TIMEOUT_S", raising=False)
    assert rank_timeout_s() == DEFAULT_RANK_TIMEOUT_S
    monkeypatch.setenv("MLXKV_RANK_TIMEOUT_S", "")
    assert rank_timeout_s() == DEFAULT_RANK_TIMEOUT_S


def test_rank_timeout_reads_seconds(monkeypatch):
    monkeypatch.setenv("MLXKV_RANK_TIMEOUT_S", "2.5")
    assert rank_timeout_s() == 2.5


@pytest.mark.parametrize("setting", ["abc", "0", "-3", "inf", "nan"])
def test_a_rank_timeout_that_is_no_wait_is_refused_naming_the_variable(monkeypatch, setting):
    monkeypatch.setenv("MLXKV_RANK_TIMEOUT_S", setting)
    with pytest.raises(ValueError, match=r"MLXKV_RANK_TIMEOUT_S='.*' is not a number of seconds"):
        rank_timeout_s()
