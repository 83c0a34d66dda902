"""Every architecture of mlx-lm whose cache has sliding windows or recurrent state (the
conformance sweep's tiny configs, `mlxkv.testing.architectures.EXPECTED_LAYERS`) decoding in
one batch: rows of different prompt lengths joining at different steps, one reader falling
behind and stopping with tokens decoded ahead, give each row's tokens and log-probabilities
alone, and leave every entry holding exactly what a fresh prefill of its tokens gives. An
architecture whose cache does not batch (`can_batch`) must say which layer kind keeps it out."""

from __future__ import annotations

import pytest

from mlxkv.cache.batched import can_batch, layer_batches
from mlxkv.cache.building import make_cache
from mlxkv.decoding.batch import DecodeBatch, batched_tokens
from mlxkv.models.loading import load_model
from mlxkv.testing.architectures import EXPECTED_LAYERS
from mlxkv.testing.factory import build_model
from tests.decoding.test_batch import _alone, _assert_holds_what_it_fed, _start
from tests.tolerances import LOGPROB_ABS

STATEFUL = sorted(arch for arch, kinds in EXPECTED_LAYERS.items() if kinds - {"KVCache"})
PROMPTS = [list(range(40, 71)), [3, 17, 5, 99, 42], list(range(100, 120))]
MAX_TOKENS = [14, 10, 12]
# Kinds that stay out of a batch, by design (`cache.batched.layer_batches`): chunked attention
# (llama4) and a model's own state class (DeepSeek V4.1's `LayerCache`), which mlx-lm has no
# batched class for.
KEPT_OUT = {"ChunkedKVCache", "LayerCache"}


@pytest.mark.parametrize("arch", STATEFUL)
def test_stateful_architectures_decode_in_a_batch_as_alone(tmp_path, arch):
    loaded = load_model(build_model(arch, tmp_path / arch))
    model = loaded.model
    empty = make_cache(model)
    if not can_batch(empty):
        out = {type(layer).__name__ for layer in empty.layers if not layer_batches(layer)}
        assert out <= KEPT_OUT, f"{arch}: {out} keep it out of a batch"
        pytest.skip(f"{arch}: {', '.join(sorted(out))} does not batch")
    alone = [_alone(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    batch = DecodeBatch(model, max_rows=3)
    rows = {}

    def start(i):
        cache, logits, pick = _start(model, PROMPTS[i])
        rows[i] = (cache, pick, batched_tokens(batch, cache, logits, pick, MAX_TOKENS[i]), [])

    def read(i):
        rows[i][3].append(next(rows[i][2]))

    start(0)
    for _ in range(2):
        read(0)
    start(1)
    read(1)
    for _ in range(3):  # row 1 falls behind: row 0 runs steps it is fed too
        read(0)
    start(2)
    read(1)
    rows[1][2].close()  # stops with tokens decoded ahead, unread
    for i in (0, 2):
        rows[i][3].extend(rows[i][2])
    for i, (cache, pick, _, streamed) in rows.items():
        want_tokens, want_logprobs = alone[i]
        assert streamed == want_tokens[: len(streamed)]
        logprobs = [pick.pop_logprob().logprob for _ in streamed]
        assert logprobs == pytest.approx(want_logprobs[: len(streamed)], abs=LOGPROB_ABS)
        _assert_holds_what_it_fed(model, cache, PROMPTS[i], streamed, want_tokens)
    assert len(rows[1][3]) == 2 and len(rows[0][3]) == MAX_TOKENS[0]
