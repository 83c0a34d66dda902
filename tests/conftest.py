import logging

import pytest

import mlxkv  # noqa: F401  (first: it picks the BLAS before mlx is imported)
from tests.factories import tiny_model_dir


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
