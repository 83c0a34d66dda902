"""`ModelCache.forward_tentative` then `keep(n)` (speculative decoding's rollback) leaves the
cache exactly as feeding the n kept tokens would: next-token logits equal the model's with no
cache at all, on every architecture (trim where layers can, restore and refeed where not)."""

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxkv.cache import make_cache
from mlxkv.testing.factory import ARCHITECTURES
from tests.tolerances import assert_logits_close

VOCAB = 512


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    prompt_tokens=st.integers(1, 20),  # the window is 8: some prompts fill the ring
)
def test_kept_tokens_give_the_logits_of_no_cache(load_tiny, arch, data, prompt_tokens):
    model, _ = load_tiny(arch)
    ids = st.integers(3, VOCAB - 1)
    prompt = data.draw(st.lists(ids, min_size=prompt_tokens, max_size=prompt_tokens))
    fed = data.draw(st.lists(ids, min_size=1, max_size=9))
    kept = data.draw(st.integers(0, len(fed)))
    probe = data.draw(ids)
    cache = make_cache(model)
    cache.forward(model, prompt)
    _, keep = cache.forward_tentative(model, fed)
    keep(kept)
    text = prompt + fed[:kept]
    assert cache.tokens == text
    got = cache.forward(model, [probe])[0, -1]
    want = model(mx.array([*text, probe])[None])[0, -1]
    assert_logits_close(got, want, f"after keeping {kept} of {len(fed)}")
