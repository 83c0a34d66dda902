"""`Runner.embed`: unit vectors from the model's final hidden states, pooled as the model asks,
checked against the model run directly (its body's output, which its own output head turns
into its logits), batched as one by one, and bad input refused before any model work."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import ContextLengthError, NotSupportedError, Runner
from mlxkv.models.loading import load_model
from mlxkv.testing.factory import build_model

TEXTS = ["hello there", "The quick brown fox jumps over the lazy dog.", "Paris", "1, 2, 3, 42"]
# float32 on the CPU: batched and single forward passes differ only in summation order.
ATOL = 1e-5


def _reference(runner: Runner, text: str, pooling: str) -> np.ndarray:
    """The model run directly on one text, pooled and normalized in numpy."""
    tokens = runner.encode(text)
    hidden = np.array(runner.loaded.model.model(mx.array([tokens]))[0], dtype=np.float64)
    vector = {"mean": hidden.mean(axis=0), "lasttoken": hidden[-1], "cls": hidden[0]}[pooling]
    return vector / np.linalg.norm(vector)


def _st_model(tmp_path, pooling_key: str):
    """A tiny llama with a sentence-transformers config asking for one pooling."""
    path = build_model("llama", tmp_path / "st")
    kinds = ("Transformer", "Pooling")
    modules = [
        {"idx": i, "path": ["", "1_Pooling"][i], "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(kinds)
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": False, pooling_key: True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return load_model(path)


def test_the_hidden_states_are_those_the_output_head_reads(make_runner):
    runner = make_runner("llama")
    tokens = mx.array([runner.encode(TEXTS[1])])
    model = runner.loaded.model
    logits = model.lm_head(model.model(tokens))
    assert mx.allclose(logits, model(tokens), atol=ATOL).item()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "lfm2"])
def test_a_batch_equals_one_by_one_and_the_model_run_directly(make_runner, arch):
    runner = make_runner(arch, max_context=256)
    batch = runner.embed(TEXTS)
    assert batch.pooling == "mean" and batch.vectors.dtype == np.float32
    for i, text in enumerate(TEXTS):
        alone = runner.embed(text).vectors[0]
        np.testing.assert_allclose(batch.vectors[i], alone, atol=ATOL)
        np.testing.assert_allclose(batch.vectors[i], _reference(runner, text, "mean"), atol=ATOL)
    np.testing.assert_allclose(np.linalg.norm(batch.vectors, axis=1), 1.0, atol=ATOL)
    similarity = batch.vectors @ batch.vectors.T
    assert (similarity[~np.eye(len(TEXTS), dtype=bool)] < 0.999).all()  # all different
    assert batch.num_tokens == sum(len(runner.encode(t)) for t in TEXTS)


@pytest.mark.parametrize(
    ("key", "pooling"),
    [("pooling_mode_lasttoken", "lasttoken"), ("pooling_mode_cls_token", "cls")],
)
def test_the_sentence_transformers_config_chooses_the_pooling(tmp_path, key, pooling):
    runner = Runner(_st_model(tmp_path, key), max_context=256)
    batch = runner.embed(TEXTS)
    assert batch.pooling == pooling
    for i, text in enumerate(TEXTS):
        np.testing.assert_allclose(batch.vectors[i], _reference(runner, text, pooling), atol=ATOL)


def test_a_model_named_for_embeddings_pools_its_last_token(tmp_path):
    runner = Runner(load_model(build_model("qwen3", tmp_path / "Qwen3-Embedding-tiny")))
    assert runner.embed(TEXTS).pooling == "lasttoken"


def test_dimensions_keep_the_first_components_normalized_again(make_runner):
    runner = make_runner("llama")
    full, cut = runner.embed(TEXTS).vectors, runner.embed(TEXTS, dimensions=16).vectors
    want = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, want, atol=ATOL)
    for bad in (0, 65, 2.5):
        with pytest.raises(ValueError, match="dimensions must be an integer from 1 to 64"):
            runner.embed(TEXTS, dimensions=bad)


def test_token_ids_embed_as_their_text(make_runner):
    runner = make_runner("llama")
    ids = [runner.encode(text) for text in TEXTS[:2]]
    np.testing.assert_array_equal(runner.embed(ids).vectors, runner.embed(TEXTS[:2]).vectors)
    np.testing.assert_array_equal(runner.embed(ids[0]).vectors, runner.embed(TEXTS[0]).vectors)


def test_an_input_over_the_window_is_refused_or_cut(make_runner):
    runner = make_runner("llama", max_context=16)
    long = " ".join(["word"] * 40)
    with pytest.raises(ContextLengthError, match="at most 16 tokens per input"):
        runner.embed(["short", long])
    cut = runner.embed(long, truncate=True)
    assert cut.num_tokens == 16
    np.testing.assert_allclose(
        cut.vectors[0], runner.embed(runner.encode(long)[:16]).vectors[0], atol=ATOL
    )


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([], "inputs must be"),
        (["fine", ""], "input 1 is an empty string"),
        ([["a"]], "input 0 must be"),
        ([[1, 99999]], "outside the vocabulary"),
        (b"bytes", "decode them to a str"),
        ([b"bytes"], "input 0 must be"),
    ],
)
def test_bad_input_is_a_value_error(make_runner, inputs, message):
    with pytest.raises(ValueError, match=message):
        make_runner("llama").embed(inputs)


def test_a_model_without_hidden_states_names_itself(make_runner):
    with pytest.raises(NotSupportedError, match="model 'mamba' .* cannot compute embeddings"):
        make_runner("mamba").embed("hello")


def test_embedding_leaves_the_prompt_cache_as_it_was(make_runner):
    runner = make_runner("llama")
    runner.generate("Once upon a time", max_tokens=4)
    before = runner.cache_tokens
    runner.embed(TEXTS)
    assert runner.cache_tokens == before
    assert runner.generate("Once upon a time", max_tokens=4).cached_tokens > 0
