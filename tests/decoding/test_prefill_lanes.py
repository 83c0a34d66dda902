"""Prefill over CPU lanes (`mlxkv.decoding.prefill.lanes`): a chunk split over two streams leaves
every kind of cache as the model with no cache computes it, and OpenBLAS gets its thread count
back."""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxkv.cache import make_cache
from mlxkv.decoding.prefill import lanes as prefill_lanes
from mlxkv.platform import blas as _blas
from mlxkv.platform.machine import cpu_cores
from mlxkv.testing.factory import ARCHITECTURES
from tests.tolerances import assert_logits_close

VOCAB = 512
pytestmark = pytest.mark.cpu_only  # lanes are CPU streams; a GPU prefills on one


@pytest.fixture
def parts_fed(monkeypatch):
    """The token counts of each `ModelCache.forward` call, in call order."""
    fed: list[int] = []
    forward = prefill_lanes.ModelCache.forward

    def counting(self, model, token_ids):
        fed.append(len(token_ids))
        return forward(self, model, token_ids)

    monkeypatch.setattr(prefill_lanes.ModelCache, "forward", counting)
    return fed


@pytest.fixture(scope="module")
def load_case(load_tiny, model_root):
    """(model, kv_bits) per case: each factory architecture with float K/V, and a llama whose
    head dimension (32) 8-bit K/V can quantize."""
    from mlx_lm import load

    from mlxkv.testing.factory import build_model

    def _load(case: str):
        if case != "llama-q8":
            return load_tiny(case)[0], None
        path = build_model("llama", f"{model_root}/llama-hd32", config_overrides={"head_dim": 32})
        return load(str(path))[0], 8

    return _load


@pytest.mark.parametrize("case", [*ARCHITECTURES, "llama-q8"])
@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), cached=st.integers(0, 40), chunk=st.integers(64, 150))
def test_a_chunk_over_two_lanes_gives_the_logits_of_one_lane(
    load_case, parts_fed, case, data, cached, chunk
):
    """The reference is the model with no cache (float K/V) or a cache fed in one piece
    (quantized K/V, whose rounding the no-cache model does not share)."""
    model, kv_bits = load_case(case)
    ids = st.integers(3, VOCAB - 1)
    prompt = data.draw(st.lists(ids, min_size=cached, max_size=cached))
    fed = data.draw(st.lists(ids, min_size=chunk, max_size=chunk))
    probe = data.draw(ids)
    cache = make_cache(model, kv_bits=kv_bits, kv_group_size=32)
    if prompt:
        cache.forward(model, prompt)
    parts_fed.clear()
    prefill_lanes.feed(model, cache, fed, 2)
    assert parts_fed == [chunk // 2, chunk - chunk // 2]  # it did split
    assert cache.tokens == prompt + fed
    got = cache.forward(model, [probe])[0, -1]
    if kv_bits:
        reference = make_cache(model, kv_bits=kv_bits, kv_group_size=32)
        want = reference.forward(model, [*prompt, *fed, probe])[0, -1]
    else:
        want = model(mx.array([*prompt, *fed, probe])[None])[0, -1]
    assert_logits_close(got, want, kv_bits=kv_bits)


def test_short_chunks_and_one_lane_are_fed_whole(load_tiny, parts_fed):
    model, _ = load_tiny("llama")
    cache = make_cache(model)
    prefill_lanes.feed(model, cache, list(range(3, 3 + 2 * prefill_lanes.MIN_PART_TOKENS - 1)), 2)
    prefill_lanes.feed(model, cache, list(range(3, 200)), 1)
    assert parts_fed == [2 * prefill_lanes.MIN_PART_TOKENS - 1, 197]


@pytest.mark.parametrize(
    ("setting", "lanes"), [("1", 1), ("3", 3), ("0", 1), ("many", 1), ("", None)]
)
def test_the_lanes_setting(monkeypatch, caplog, setting, lanes):
    monkeypatch.setenv("MLXKV_PREFILL_LANES", setting)
    got = prefill_lanes.default_lanes()
    if lanes is None:  # the default: up to 2, one per core
        assert got == max(1, min(2, cpu_cores()))
    else:
        assert got == lanes
    assert ("not a number of lanes" in caplog.text) == (setting == "many")


def _openblas_threads() -> int:
    path = _blas.blas_in_use.removeprefix("OpenBLAS (").removesuffix(")")
    return ctypes.CDLL(path).openblas_get_num_threads()


@pytest.mark.skipif(not _blas.blas_in_use.startswith("OpenBLAS"), reason="needs OpenBLAS")
def test_blas_threads_come_back_after_the_block_even_when_it_raises():
    before = _openblas_threads()
    with _blas.blas_threads(1):
        assert _openblas_threads() == 1
    assert _openblas_threads() == before
    with pytest.raises(RuntimeError), _blas.blas_threads(1):
        raise RuntimeError("inside")
    assert _openblas_threads() == before


@pytest.mark.skipif(not _blas.blas_in_use.startswith("OpenBLAS"), reason="needs OpenBLAS")
def test_a_library_that_is_not_blas_is_warned_about_not_used():
    """MLXKV_OPENBLAS naming a library without BLAS (libm here) was loaded and reported as
    "OpenBLAS (libm.so.6)"; it is warned about and the usual places are tried."""
    maps = Path("/proc/self/maps").read_text().split()
    libm = next(f for f in maps if Path(f).name.startswith("libm.so"))
    result = subprocess.run(
        [sys.executable, "-c", "import mlxkv.platform.blas as b; print(b.blas_in_use)"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MLXKV_OPENBLAS": libm},
    )
    assert "is not a BLAS library (it has no sgemm_)" in result.stderr, result.stderr
    assert result.stdout.startswith("OpenBLAS (") and libm not in result.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="BLAS is chosen on Linux only")
def test_another_blas_is_not_reported_as_openblas(monkeypatch):
    """A BLAS without OpenBLAS's functions (MKL, BLIS, reference) is named as a BLAS, and its
    threads are left alone."""
    monkeypatch.delitem(sys.modules, "mlx.core")
    monkeypatch.setattr(_blas, "blas_in_use", _blas.blas_in_use)
    monkeypatch.setattr(_blas, "_openblas", _blas._openblas)
    monkeypatch.setattr(_blas, "_load", lambda setting: (Path("/opt/blis/libblis.so"), object()))
    assert _blas.select_blas() == "BLAS (/opt/blis/libblis.so)" and _blas._openblas is None
