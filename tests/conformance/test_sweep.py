"""The conformance sweep: every architecture the installed mlx-lm ships, built tiny from a
config (`mlxkv.testing.architectures`), runs a 4-turn chat, a retry and an edit on one Runner
that answer exactly as a cold Runner does (by log-probabilities) while reusing the prompt,
and a context shift it claims to do in place moves every layer's K/V exactly.

Each model must be able to see what is checked (changing one token early in the prompt moves
the last logits, else the architecture is reported blind, not passed) and must really have
its distinctive layers (windows shorter than the prompt, recurrent state, chunks, shared K/V,
and the experts, latent attention and attention sinks its model file can build).
A model module mlx-lm adds fails `test_every_mlx_lm_architecture_is_swept` by name until it
gets a tiny config or a reason in `NOT_COVERED`.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import mlx.core as mx
import mlx_lm.models
import pytest
from mlx.utils import tree_flatten

from mlxkv import Runner
from mlxkv.cache import KVCache, make_cache
from mlxkv.errors import NotSupportedError
from mlxkv.models.loading import load_model
from mlxkv.models.rope import rope_rotations
from mlxkv.testing.architectures import (
    EXPECTED_LAYERS,
    NOT_COVERED,
    REACH_TOKENS,
    SWEEP_CONFIGS,
)
from mlxkv.testing.factory import ARCHITECTURES, build_model

SWEPT = sorted(set(SWEEP_CONFIGS) | set(ARCHITECTURES))
# Sized so every window (8 tokens) and chunk is far shorter than a turn's prompt.
_TURNS = [
    "Tell me about the capital of France and the river that runs through it.",
    "And what about Italy? Name its capital and one famous building there.",
    "Now compare the two cities by size, by age and by the food people eat.",
    "Finally, which one should a small model visit first, and why exactly?",
]
_REPLY_TOKENS = 5
_LOGPROB_TOLERANCE = 1e-3  # float32 on CPU: the same tokens through other chunkings
_MIN_REUSE = 0.5  # of turn 4's prompt, from the cache


def _model_modules() -> list[str]:
    """mlx-lm's model modules, read from its sources (importing some needs extra packages):
    those that define `Model` or take another module's under settings of their own
    (solar_open is glm4_moe's `Model` with its own `ModelArgs`)."""
    folder = Path(mlx_lm.models.__file__).parent
    has_model = re.compile(r"^(class Model\(|from \.\w+ import (.*, )?Model\b)", re.MULTILINE)
    return sorted(p.stem for p in folder.glob("*.py") if has_model.search(p.read_text()))


def test_every_mlx_lm_architecture_is_swept():
    modules = set(_model_modules())
    unknown = sorted(modules - set(SWEPT) - set(NOT_COVERED))
    assert not unknown, (
        f"mlx-lm ships architectures the sweep does not cover: {', '.join(unknown)}. Give each "
        "a tiny config in mlxkv/testing/architectures.py (or a reason in NOT_COVERED)"
    )
    gone = sorted((set(SWEPT) | set(NOT_COVERED)) - modules)
    assert not gone, f"no longer in mlx-lm: {', '.join(gone)}"
    assert not set(SWEPT) & set(NOT_COVERED)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    models = {}

    def load(arch: str):
        if arch not in models:
            models[arch] = load_model(build_model(arch, root / arch))
        return models[arch]

    return load


def _leaves(cache) -> list:
    return [c for layer in cache for c in (getattr(layer, "caches", None) or [layer])]


def _kinds(cache) -> set[str]:
    return {type(layer).__name__ for layer in _leaves(cache)}


def _assert_windows_shorter(arch: str, cache, prompt_tokens: int) -> None:
    """Every sliding window and attention chunk is shorter than the first turn's prompt, so
    each request runs past them (a window longer than the chat would test a plain cache)."""
    windows = [getattr(c, "window", None) or getattr(c, "chunk_size", 0) for c in _leaves(cache)]
    longest = max(windows, default=0)
    assert longest < prompt_tokens, (
        f"{arch}: a window of {longest} tokens is not shorter than the first prompt "
        f"({prompt_tokens} tokens); give its tiny config a shorter one"
    )


# What a model file can build, by the words its source uses for it.
_PARTS = {
    "experts": ("SwitchGLU", "SwitchMLP"),
    "latent attention": ("kv_lora_rank",),
    "attention sinks": ("sinks", "sink_bias"),
}


def _built_parts(model) -> set[str]:
    modules = [module for _, module in model.named_modules()]
    built = set()
    if any(type(module).__name__ in _PARTS["experts"] for module in modules):
        built.add("experts")
    if any(getattr(module, "kv_lora_rank", 0) for module in modules):
        built.add("latent attention")
    if any("sink" in name for name, _ in tree_flatten(model.parameters())):
        built.add("attention sinks")
    return built


def _assert_parts_present(arch: str, model) -> None:
    """The experts, latent attention (MLA) and sinks the architecture's mlx-lm module can
    build are in the tiny model (a config that leaves them off would test a plainer model)."""
    source = inspect.getsource(importlib.import_module(f"mlx_lm.models.{arch}"))
    wanted = {part for part, words in _PARTS.items() if any(w in source for w in words)}
    missing = wanted - _built_parts(model)
    assert not missing, f"{arch}: its tiny config builds no {', '.join(sorted(missing))}"


def _answer(runner: Runner, messages: list[dict]) -> tuple[list[int], list[float], float]:
    """Greedy reply: tokens, their log-probabilities, and the share of the prompt reused."""
    chunks = list(runner.stream(messages, max_tokens=_REPLY_TOKENS, temperature=0, logprobs=0))
    done = chunks[-1].completion
    logprobs = [c.logprob.logprob for c in chunks if c.logprob is not None]
    return done.tokens, logprobs, done.cached_tokens / done.prompt_tokens


def _last_logprobs(model, ids: list[int]) -> mx.array:
    logits = make_cache(model).forward(model, ids)[0, -1]
    return logits - mx.logsumexp(logits)


def _assert_context_matters(arch: str, model, prompt: list[int]) -> None:
    """The sweep's power: changing one token far back moves the last log-probabilities."""
    back = min(len(prompt) - 4, REACH_TOKENS.get(arch, len(prompt)))
    edited = list(prompt)
    edited[-back] = (edited[-back] + 1) % 256
    moved = mx.abs(_last_logprobs(model, prompt) - _last_logprobs(model, edited)).max().item()
    assert moved > 1e-3, f"{arch} is blind: a token {back} back moves nothing ({moved:.2g})"


def _chat_requests(runner: Runner) -> list[list[dict]]:
    """Four turns of a chat (the replies the runner's own), a retry of the last, an edit."""
    messages: list[dict] = []
    requests = []
    for turn in _TURNS:
        messages = messages + [{"role": "user", "content": turn}]
        requests.append(list(messages))
        tokens, _, _ = _answer(runner, messages)
        messages.append({"role": "assistant", "content": runner.tokenizer.decode(tokens)})
    requests.append(requests[-1])
    requests.append(requests[-1][:-1] + [{"role": "user", "content": "Edited: " + _TURNS[3]}])
    return requests


@pytest.mark.parametrize("arch", SWEPT)
def test_architecture_reuses_its_cache_exactly(loaded, arch):
    model = loaded(arch)
    layers = make_cache(model.model)
    assert _kinds(layers) == EXPECTED_LAYERS.get(arch, {"KVCache"})
    _assert_parts_present(arch, model.model)
    warm = Runner(model, max_context=1024, warmup=False)
    cold = Runner(model, max_context=1024, warmup=False)
    first_prompt = warm.encode([{"role": "user", "content": _TURNS[0]}])
    _assert_windows_shorter(arch, layers, len(first_prompt))
    _assert_context_matters(
        arch, model.model, warm.encode([{"role": "user", "content": _TURNS[0] * 3}])
    )
    requests = _chat_requests(warm)
    warm.reset()
    reuses = []
    for i, request in enumerate(requests):
        got_tokens, got, reuse = _answer(warm, request)
        cold.reset()
        want_tokens, want, _ = _answer(cold, request)
        assert got_tokens == want_tokens, f"{arch}: request {i} answers otherwise warm"
        worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
        assert worst <= _LOGPROB_TOLERANCE, f"{arch}: request {i} log-probabilities {worst:.2g}"
        reuses.append(round(reuse, 2))
    assert min(reuses[1:]) > 0 and reuses[3] >= _MIN_REUSE, f"{arch}: reused {reuses}"


def _layer_inputs(model, cache, ids: list[int]) -> dict[int, tuple]:
    """Each layer's call arguments (positional, keyword) while `cache` is fed `ids`."""
    seen: dict[int, tuple] = {}
    classes = {type(layer) for layer in model.layers}
    calls = {cls: cls.__call__ for cls in classes}

    def recording(call):
        def record(self, *args, **kwargs):
            seen[id(self)] = (args, kwargs)
            return call(self, *args, **kwargs)

        return record

    try:
        for cls in classes:
            cls.__call__ = recording(calls[cls])
        cache.forward(model, ids)
    finally:
        for cls in classes:
            cls.__call__ = calls[cls]
    return seen


def _fresh_layer_kv(layer, call: tuple, positions: mx.array) -> tuple[mx.array, mx.array]:
    """The K/V `layer` stores when fed, on an empty cache, the hidden states of its recorded
    `call` at `positions` only (so at positions 0...). The mask is dropped: it changes what
    attention reads, never the K/V stored."""
    args, kwargs = list(call[0]), dict(call[1])
    fresh = KVCache()
    hidden = next(k for k in kwargs if k not in ("mask", "cache")) if not args else None
    if hidden is None:
        args[0] = args[0][:, positions]
    else:
        kwargs[hidden] = kwargs[hidden][:, positions]
    kwargs = {k: (fresh if k == "cache" else None if k == "mask" else v) for k, v in kwargs.items()}
    args = args[:1] + [None if isinstance(a, (mx.array, str)) else a for a in args[1:]]
    if "cache" not in kwargs:  # called as layer(x, mask, cache)
        args = [*args[:1], None, fresh, *args[3:]]
    layer(*args, **kwargs)
    return fresh.state


@pytest.mark.parametrize("arch", SWEPT)
def test_a_claimed_shift_moves_every_layers_k_v_exactly(loaded, arch):
    """Where `can_shift` claims an in-place shift, each layer's shifted K/V equal what that
    layer stores when fed, afresh at the kept tokens' new positions, the same hidden states
    it was fed: the re-rotation is exact for that layer's RoPE (the one-layer test in
    tests/runner/test_context.py covers five RoPE kinds; this, every architecture). Deeper
    layers' inputs were computed with the dropped tokens in context: that approximation is
    the shift's by design, and not what is checked. Elsewhere a shift is refused."""
    model = loaded(arch).model
    cache, rotations = make_cache(model), rope_rotations(model)
    held, keep, drop = 30, 4, 11
    inputs = _layer_inputs(model, cache, [(7 * i + 3) % 400 for i in range(held)])
    if not cache.can_shift(rotations):
        with pytest.raises(NotSupportedError):
            cache.shift(keep, drop, rotations)
        return
    cache.shift(keep, drop, rotations)
    kept = mx.array([*range(keep), *range(keep + drop, held)])
    for i, layer in enumerate(model.layers):
        want = _fresh_layer_kv(layer, inputs[id(layer)], kept)
        pairs = zip(cache.layers[i].state, want, ("keys", "values"), strict=True)
        for got, expected, what in pairs:
            worst = mx.abs(got - expected).max().item() / mx.abs(expected).max().item()
            assert worst < 1e-5, f"{arch}: layer {i} {what} off by {worst:.2g} (relative)"


@pytest.mark.parametrize("arch", SWEPT)
def test_the_farthest_trim_the_cache_allows_is_exact(loaded, arch):
    """`can_trim_to` reaches no further back than the held history allows: after a prefill
    and decode steps (which move windows and drop old chunks), the cache trimmed to the
    shortest length it allows, then fed other tokens, gives a cold cache's log-probabilities.
    The chat above never asks for that edge (its retries go back a few tokens, its edits
    past every window), so a reach one chunk or window too long passed it; the property
    machines (tests/property/) check each class's reach both ways, this every model's cache."""
    model = loaded(arch).model
    ids = [(7 * i + 3) % 400 for i in range(40)]
    cache = make_cache(model)
    cache.forward(model, ids[:30])
    for token in ids[30:]:
        cache.forward(model, [token])
    shortest = min(n for n in range(1, len(ids) + 1) if cache.can_trim_to(n))
    cache.trim_to(shortest)
    other = [(token + 5) % 400 for token in ids[shortest:]] or [11]
    got = cache.forward(model, other)[0]
    want = make_cache(model).forward(model, ids[:shortest] + other)[0, shortest:]
    got, want = (x - mx.logsumexp(x, axis=-1, keepdims=True) for x in (got, want))
    worst = mx.abs(got - want).max().item()
    assert worst <= _LOGPROB_TOLERANCE, (
        f"{arch}: trimmed to {shortest} of {len(ids)} tokens, log-probabilities {worst:.2g} off"
    )
