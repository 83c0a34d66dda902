import logging
import re

import pytest

import mlxkv  # noqa: F401  (first: it picks the BLAS before mlx is imported)
from tests.factories import tiny_model_dir, wait_until


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run only where MLX's default device is a GPU, `cpu_only` ones only where
    it is the CPU."""
    from mlxkv.platform.machine import on_gpu

    skipped = "cpu_only" if on_gpu() else "gpu"
    reason = "needs MLX's CPU backend" if on_gpu() else "needs MLX on a GPU"
    for item in items:
        if item.get_closest_marker(skipped):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def load_tiny(model_root):
    """Loads a tiny factory model through mlx-lm's real loading code, once per architecture."""
    from mlx_lm import load

    loaded = {}

    def _load(arch: str):
        if arch not in loaded:
            loaded[arch] = load(str(tiny_model_dir(arch, model_root)))
        return loaded[arch]

    return _load


@pytest.fixture(autouse=True)
def checked_runners(request, monkeypatch):
    """After every request of every Runner in the test, its entry must hold what it fed and
    the idle entries' recorded bytes what they hold (`tests/invariants.py`); a test marked
    `unchecked_entries` opts out (it breaks the model on purpose, so a fresh prefill cannot
    be the reference, or it counts a request's calls)."""
    if request.node.get_closest_marker("unchecked_entries"):
        return
    from mlxkv.cache.model_cache import ModelCache
    from mlxkv.runner.dispatch import Dispatcher
    from tests.invariants import (
        Fed,
        assert_entry_holds_what_it_fed,
        assert_recorded_bytes_current,
        recording,
    )

    run, end = Dispatcher._run, Dispatcher._end_request

    def recording_run(self, request, on_entry, *args):
        fed = Fed(list(request.tokens), images=request.images)

        def noting_entry(entry):
            entry.fed_in_test = fed  # the request chose it (one cancelled first touches none)
            on_entry(entry)

        return recording(run(self, request, noting_entry, *args), fed)

    def checked_end(self, entry):
        end(self, entry)
        if entry is not None:
            assert_entry_holds_what_it_fed(self, entry, entry.__dict__.pop("fed_in_test", None))
        assert_recorded_bytes_current(self._pool)

    shift = ModelCache.shift

    def noting_shift(self, *args, **kwargs):
        self.shifted = True  # deeper layers keep K/V computed with the dropped tokens (README)
        return shift(self, *args, **kwargs)

    monkeypatch.setattr(ModelCache, "shift", noting_shift)
    monkeypatch.setattr(Dispatcher, "_run", recording_run)
    monkeypatch.setattr(Dispatcher, "_end_request", checked_end)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def loaded_tiny(model_root):
    """LoadedModel per architecture, through mlxkv's own loading path, once per session."""
    from mlxkv.models.loading import load_model

    loaded = {}

    def _get(arch: str):
        if arch not in loaded:
            loaded[arch] = load_model(tiny_model_dir(arch, model_root))
        return loaded[arch]

    return _get


@pytest.fixture
def make_runner(loaded_tiny):
    """A Runner on a tiny factory model (loaded once per session), with these settings."""
    from mlxkv import Runner

    def _make(arch: str = "llama", **kwargs) -> Runner:
        return Runner(loaded_tiny(arch), **kwargs)

    return _make


@pytest.fixture
def access_log(caplog):
    """Waits for the `count`-th access-log line matching a pattern (lines are logged once the
    response has ended, so after the client has it) and returns its match."""
    caplog.set_level(logging.INFO, logger="mlxkv.server.access")

    def wait_for(pattern: str, count: int = 1) -> re.Match:
        found = []

        def matched() -> bool:
            found[:] = [m for r in caplog.records if (m := re.search(pattern, r.getMessage()))]
            return len(found) >= count

        wait_until(matched, what=f"{count} access line(s) matching {pattern!r}")
        return found[count - 1]

    return wait_for
