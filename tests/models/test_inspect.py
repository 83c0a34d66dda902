"""`mlxkv info`'s facts about a model's cache: its layer kinds and what the cache can do with
them, which must be what the runner decides (trim, restore from checkpoints, shift)."""

import pytest

from mlxkv.cache import make_cache
from mlxkv.models.inspect import describe
from mlxkv.models.rope import rope_rotations

CASES = {
    "llama": ("full attention: 2 (0, 1)", "trim any number of tokens; shift in place when full"),
    "gemma3_text": (
        "sliding window 8: 2 (0, 1); full attention: 1 (2)",
        "trim only within the window or chunk; restore checkpoints further back; no shift",
    ),
    "lfm2": (
        "recurrent state: 2 (0, 2); full attention: 1 (1)",
        "no trim (recurrent or other state that cannot go back); restore checkpoints further "
        "back; no shift",
    ),
}


@pytest.mark.parametrize("arch", CASES)
def test_info_names_layer_kinds_and_what_the_cache_can_do(loaded_tiny, arch):
    loaded = loaded_tiny(arch)
    facts = describe(loaded)
    kinds, abilities = CASES[arch]
    assert facts["cache layers"] == kinds
    assert facts["cache can"].startswith(abilities)
    cache = make_cache(loaded.model)
    cache.forward(loaded.model, [1, 2, 3])
    assert ("restore checkpoints" in facts["cache can"]) == cache.needs_checkpoints
    assert ("shift in place" in facts["cache can"]) == cache.can_shift(rope_rotations(loaded.model))


@pytest.mark.parametrize(("arch", "shown"), [("llama", "4096 tokens"), ("mamba", "unknown")])
def test_info_max_context_has_a_unit_only_when_known(loaded_tiny, arch, shown):
    assert describe(loaded_tiny(arch))["max context"] == shown
