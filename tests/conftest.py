import logging
import os
import re
import threading

import pytest

# MLX runs float32 matmuls in TF32 by default where the hardware has it (CUDA GPUs, M5-class
# Macs): about 2.5e-3 relative between two chunkings of one forward pass on an H200, 25x this
# suite's float32 bound there. The parity tests compare two computations of the same logits, so
# they ask for full float32 (read at MLX's first matmul; a value set by hand is kept).
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlxkv  # noqa: E402, F401  (first: it picks the BLAS before mlx is imported)
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
def checked_runners(request):
    """After every request of every Runner in the test, its entry must hold what it fed and
    the idle entries' recorded bytes what they hold (`tests/invariants.py`); a test marked
    `unchecked_entries` opts out (it breaks the model on purpose, so a fresh prefill cannot
    be the reference, or it counts a request's calls)."""
    if request.node.get_closest_marker("unchecked_entries"):
        yield
        return
    from mlxkv.runner.hooks import request_ends
    from tests.invariants import assert_entry_holds_what_it_fed, assert_recorded_bytes_current

    failures: list[BaseException] = []

    def check(end):
        fed = end.prompt + end.generated
        try:
            assert_entry_holds_what_it_fed(end.context, end.entry, fed, end.images)
            assert_recorded_bytes_current(end.context.pool)
        except BaseException as error:  # a stream closed early only logs it (engine.py)
            failures.append(error)
            raise

    with request_ends(check):
        yield
    if failures:
        raise failures[0]


@pytest.fixture(autouse=True)
def _logging_as_found():
    """Each test starts with mlxkv's loggers as the suite found them: the CLI, run in-process
    by some tests, sets levels and adds handlers for its own process (`serve` quiets the
    memory line, which a later test's caplog then never sees)."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    loggers = logging.root.manager.loggerDict
    levels = {
        name: logger.level
        for name, logger in loggers.items()
        if name.split(".")[0] == "mlxkv" and isinstance(logger, logging.Logger)
    }
    handlers = list(logging.getLogger("mlxkv").handlers)
    yield
    for name, logger in list(loggers.items()):
        if name.split(".")[0] == "mlxkv" and isinstance(logger, logging.Logger):
            logger.setLevel(levels.get(name, logging.NOTSET))
    logging.getLogger("mlxkv").handlers[:] = handlers


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


@pytest.fixture(scope="session")
def loaded_quantizable(model_root):
    """The tiny llama with a head dimension of 64 (its own is 16, under every K/V group size),
    so that `kv_bits` with `kv_group_size=64` quantizes its K/V, a shape MLX's CUDA build has
    kernels for too (none for 8 bits in groups of 32 at head size 32); loaded once a session."""
    from mlxkv.models.loading import load_model
    from mlxkv.testing.factory import build_model

    path = build_model("llama", f"{model_root}/llama-hd64-q", config_overrides={"head_dim": 64})
    return load_model(path)


_FLUSH_TIMEOUT_S = 120  # a writer held by the test for good fails it instead of hanging CI


@pytest.fixture
def make_runner(loaded_tiny):
    """A Runner on a tiny factory model (loaded once per session), with these settings. At
    the test's end, the disk writes its Runners queued are waited for: a Runner dropped
    unclosed stops its writer without waiting, and writes going on into the next test would
    meet its patches and its log capture."""
    from mlxkv import Runner

    stores = []  # not the Runners: tests see a dropped one collected

    def _make(arch: str = "llama", **kwargs) -> Runner:
        runner = Runner(loaded_tiny(arch), **kwargs)
        if runner._pool.store is not None:
            stores.append(runner._pool.store)
        return runner

    yield _make
    flushed = threading.Thread(target=lambda: [store.flush() for store in stores], daemon=True)
    flushed.start()
    flushed.join(_FLUSH_TIMEOUT_S)
    assert not flushed.is_alive(), "the disk writes of the test's Runners never ended"


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
