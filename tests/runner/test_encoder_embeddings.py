"""Encoder embedding models (a tiny random BERT) through mlx-embeddings: `Runner.embed` equals
mlx-embeddings' own vectors (a batch of texts of different lengths: the padding is masked),
a batch equals its texts one by one, generation is refused by name, and the server embeds
with it and refuses to chat with it."""

from __future__ import annotations

import numpy as np
import pytest

from mlxkv import Runner
from mlxkv.errors import ModelLoadError, NotSupportedError

mlx_embeddings = pytest.importorskip(
    "mlx_embeddings", reason="mlx-embeddings is not installed (pip install 'mlxkv[embeddings]')"
)

TEXTS = ["Paris is the capital of France", "hello", "The cat sat on the mat by the door"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    from mlxkv.testing.encoder_factory import build_encoder_model

    return build_encoder_model(tmp_path_factory.mktemp("encoder") / "tiny-bert")


@pytest.fixture(scope="module")
def runner(bert_dir):
    return Runner.load(str(bert_dir), max_context=128)


def test_runner_embed_equals_mlx_embeddings_own_vectors(runner, bert_dir):
    model, tokenizer = mlx_embeddings.load(str(bert_dir))
    want = np.array(mlx_embeddings.generate(model, tokenizer, texts=TEXTS).text_embeds)
    got = runner.embed(TEXTS)
    np.testing.assert_allclose(got.vectors, want, atol=1e-5)
    assert got.pooling == "mean"
    assert got.num_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)


def test_a_batch_equals_its_texts_one_by_one_unit_and_distinct(runner):
    batch = runner.embed(TEXTS).vectors
    alone = np.stack([runner.embed(text).vectors[0] for text in TEXTS])
    np.testing.assert_allclose(batch, alone, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    assert np.abs(batch[0] - batch[1]).max() > 1e-3


def test_an_encoder_does_not_generate(runner):
    from mlxkv.models.inspect import describe

    with pytest.raises(NotSupportedError, match="'tiny-bert' is an encoder embedding model"):
        runner.generate("Hello", max_tokens=2)
    facts = describe(runner.loaded)  # `mlxkv info`
    assert facts["capabilities"] == "embedding" and facts["kv bytes per token"].startswith("0 ")


def test_without_mlx_embeddings_loading_says_how_to_install(bert_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mlx_embeddings.utils", None)
    with pytest.raises(ModelLoadError, match=r"mlxkv\[embeddings\]"):
        Runner.load(str(bert_dir))


def test_the_server_embeds_with_it_and_refuses_to_chat(runner):
    """The refusal names the model as the client does (served as "notes"), not by its
    directory ("tiny-bert")."""
    from tests.server.conftest import serve

    with serve(runner, model_name="notes") as served:
        client = served.openai()
        reply = client.embeddings.create(model="notes", input=TEXTS, encoding_format="float")
        got = np.array([item.embedding for item in reply.data])
        np.testing.assert_allclose(got, runner.embed(TEXTS).vectors, atol=1e-6)
        status, body = served.post(
            "/v1/chat/completions",
            {"model": "notes", "messages": [{"role": "user", "content": "Hi"}]},
        )
    assert status == 400
    assert body["error"]["message"].startswith("model 'notes' is an encoder embedding model")


def test_it_starts_with_a_disk_tier_as_a_server_sets_one(bert_dir, tmp_path):
    """`mlxkv serve` sets a cache directory by default: the disk tier's one-token probe of the
    model's cache shapes ran the encoder, which refuses to, and no Runner started."""
    with Runner.load(str(bert_dir), max_context=128, cache_dir=tmp_path) as runner:
        assert runner.embed(TEXTS).vectors.shape[0] == len(TEXTS)
