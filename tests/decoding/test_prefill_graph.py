"""The device work of a prefill chunk and a decode step: mlxkv evaluates no more than mlx-lm
does on the same model (the GPU's prefill gap was first suspected there; see
benchmarks/graph_compare.py). Counted on the graph each side hands `mx.eval`, by primitive:
what the CPU builds is what a GPU runs."""

import re
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxkv.cache import make_cache

CHUNK_TOKENS = 96
# Ops that copy or convert K/V and logits: a K/V buffer copied per chunk, a dtype conversion
# or logits computed for the whole chunk would each change one of these counts.
HEAVY_OPS = ("Concatenate", "SliceUpdate", "AsType", "Matmul", "Softmax", "Gather", "Full")
_LABEL = re.compile(r'label ="([A-Za-z0-9_]+)"')


def _ops(path, arrays) -> Counter:
    """The primitives of the lazy graph that evaluating `arrays` runs."""
    mx.export_to_dot(str(path), *(a for a in arrays if isinstance(a, mx.array)))
    return Counter(_LABEL.findall(path.read_text()))


def _ids(count: int, seed: int) -> list[int]:
    return mx.random.randint(3, 500, (count,), key=mx.random.key(seed)).tolist()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, model_root):
    """The tiny llama, loaded afresh in each dtype (a bfloat16 model shows conversions)."""
    from mlx_lm import load

    from tests.factories import tiny_model_dir

    loaded = load(str(tiny_model_dir("llama", model_root)))[0]
    loaded.set_dtype(getattr(mx, request.param))
    return loaded


@pytest.mark.parametrize("cached_tokens", [0, 300], ids=["empty", "after-300"])
def test_a_chunk_evaluates_what_mlx_lm_evaluates(model, tmp_path, monkeypatch, cached_tokens):
    cached, chunk = _ids(cached_tokens, 1), _ids(CHUNK_TOKENS, 2)
    theirs = make_prompt_cache(model)
    if cached:
        model(mx.array(cached)[None], cache=theirs)
        mx.eval([c.state for c in theirs])
    model(mx.array(chunk)[None], cache=theirs)  # mlx-lm's generate_step prefill loop
    their_ops = _ops(tmp_path / "theirs.dot", [a for c in theirs for a in c.state])

    ours = make_cache(model)
    if cached:
        ours.feed(model, cached)
    seen: list[Counter] = []
    monkeypatch.setattr(mx, "eval", lambda *a: seen.append(_ops(tmp_path / "ours.dot", *a)))
    ours.feed(model, chunk)

    assert len(seen) == 1, "one evaluation per chunk, as mlx-lm"
    for op in HEAVY_OPS:
        assert seen[0][op] == their_ops[op], op
    # the rest differs only in how the token ids enter (a reshape against a slice)
    assert abs(sum(seen[0].values()) - sum(their_ops.values())) <= 2


def test_a_decode_step_evaluates_no_more_than_mlx_lm(model, tmp_path):
    from mlxkv.decoding.picker import TokenPicker
    from mlxkv.decoding.sampling import SamplingParams

    prompt = _ids(40, 3)
    theirs = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=theirs)
    mx.eval([c.state for c in theirs])
    logits = model(mx.array([7])[None], cache=theirs)[:, -1, :]  # generate_step's _step
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    their_ops = _ops(tmp_path / "theirs.dot", [mx.argmax(logprobs, axis=-1)])

    ours = make_cache(model)
    ours.feed(model, prompt)
    sampling = SamplingParams(temperature=0.0).make_sampling(512)
    pick = TokenPicker(sampling.sampler, [], prompt, greedy=True)
    our_ops = _ops(tmp_path / "ours.dot", [pick(ours.forward(model, [7])[:, -1, :])])

    for op in HEAVY_OPS:
        assert our_ops[op] <= their_ops[op], op
    assert sum(our_ops.values()) <= sum(their_ops.values())
