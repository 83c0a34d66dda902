import pytest

from mlxkv import Runner


@pytest.fixture
def make_runner(loaded_tiny):
    def _make(arch: str = "llama", **kwargs) -> Runner:
        return Runner(loaded_tiny(arch), **kwargs)

    return _make
