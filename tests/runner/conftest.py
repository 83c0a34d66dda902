import pytest

from mlxkv import Runner
from mlxkv.runner.loading import load_model
from tests.factories import tiny_model_dir


@pytest.fixture(scope="session")
def loaded_tiny(model_root):
    """LoadedModel per architecture, through mlxkv's own loading path, once per session."""
    loaded = {}

    def _get(arch: str):
        if arch not in loaded:
            loaded[arch] = load_model(tiny_model_dir(arch, model_root))
        return loaded[arch]

    return _get


@pytest.fixture
def make_runner(loaded_tiny):
    def _make(arch: str = "llama", **kwargs) -> Runner:
        return Runner(loaded_tiny(arch), **kwargs)

    return _make
