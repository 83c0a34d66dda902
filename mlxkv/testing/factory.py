"""Small models of real mlx-lm architectures, with random weights and a real tokenizer.

Owns: building a model directory in Hugging Face layout (`config.json`, `model.safetensors`,
`tokenizer.json`, `tokenizer_config.json`) that `mlx_lm.load` and `mlxkv.Runner.load` read like
any downloaded model. No model hub is needed, so tests, examples and benchmarks can exercise the
real loading code offline. Does not own: loading (see `mlxkv.models.loading`).

Architectures (`ARCHITECTURES`):
  llama        plain causal attention
  qwen3        causal attention with q/k norms
  gemma3_text  sliding-window layers mixed with global layers
  spark2_5     every layer a sliding window
  lfm2         hybrid: short-convolution (recurrent state) layers and attention layers
  mamba        every layer recurrent (state-space)
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxkv.testing.architectures import SWEEP_CONFIGS
from mlxkv.testing.tiny_attention import BASE_CONFIG
from mlxkv.testing.tiny_recurrent import LFM2_CONFIG

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A ChatML template that takes tools and renders tool calls and results the way Qwen2.5 and
# Hermes models do; mlx-lm picks its `json_tools` parser for it (`<tool_call>`, tool_call.name).
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You may call functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call one as <tool_call>{"name": name, "arguments": {...}}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant\n{{ message['content'] }}"
    "{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>{{ message['content'] }}</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """
The cache holds keys and values for every token the model has seen. A chat grows by a few
hundred tokens each turn, and the runner should never compute the same prefix twice. Paris is
the capital of France; Rome is the capital of Italy; Berlin is the capital of Germany.
Once upon a time there was a small model that answered questions about the weather, numbers
like 1, 2, 3, 42 and 1000, and code such as def f(x): return x + 1. The quick brown fox jumps
over the lazy dog. user assistant system: hello, how are you? I am fine, thank you!
"""

# mlx-lm's initial weights times this, with an untied output head: the next token then depends
# on the whole context on every architecture (the conformance sweep measures it: a token far
# back must move the last log-probabilities, tests/conformance/test_sweep.py). With
# smaller weights or a head tied to the embeddings, most architectures answer the same token
# whatever the context, so token-level tests could not see a corrupted cache.
WEIGHT_SCALE = 2.0

# Each entry: the config of a tiny model (2 layers, hidden 64) that runs in milliseconds on one
# CPU core. "size" overrides scale them up for benchmarks.
_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**BASE_CONFIG, "model_type": "llama"},
    "qwen3": {**BASE_CONFIG, "model_type": "qwen3"},
    "gemma3_text": {
        **BASE_CONFIG,
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
        "query_pre_attn_scalar": 16,
        "rope_local_base_freq": 10000.0,
    },
    "spark2_5": {
        **BASE_CONFIG,
        "model_type": "spark2_5",
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    "lfm2": LFM2_CONFIG,
    "mamba": {
        "model_type": "mamba",
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 8,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 4,
        "tie_word_embeddings": False,
    },
}
ARCHITECTURES: tuple[str, ...] = tuple(_CONFIGS)

_SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    # About 100M parameters with a 512-token vocabulary: what the benchmarks call "medium".
    "100m": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "intermediate_size": 3072,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
}


def build_model(
    arch: str,
    out_dir: str | Path,
    *,
    size: str = "tiny",
    vocab_size: int = 512,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
    chat_template: str = CHAT_TEMPLATE,
    added_tokens: Sequence[str] = (),
) -> Path:
    """Writes a random-weight model of architecture `arch` in Hugging Face layout.

    Args:
        arch: one of `ARCHITECTURES`, or of `architectures.SWEEP_CONFIGS` (an mlx-lm module).
        out_dir: directory to create (parents too); existing files in it are overwritten.
        size: "tiny" (tests) or "100m" (benchmarks).
        vocab_size: tokens in the trained tokenizer and the embedding table.
        seed: seeds the weights, so the same arguments give the same model.
        config_overrides: keys replaced in the config (e.g. a longer sliding window).
        chat_template: the tokenizer's Jinja chat template.
        added_tokens: strings the tokenizer keeps whole, each one token after the trained
            vocabulary (the embedding table grows to hold them).

    Returns:
        The directory, ready for `mlx_lm.load` or `mlxkv.Runner.load`.

    Raises:
        ValueError: for an unknown architecture or size.
    """
    configs = {**SWEEP_CONFIGS, **_CONFIGS}
    if arch not in configs:
        raise ValueError(
            f"unknown architecture {arch!r}; choose one of {', '.join(sorted(configs))}"
        )
    if size not in _SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(_SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**configs[arch], **_SIZES[size], "vocab_size": vocab_size}
    config.update(config_overrides or {})
    if arch == "lfm2":
        config["block_dim"] = config["hidden_size"]
        config["block_ff_dim"] = config["intermediate_size"]
    tokenizer_ids = _write_tokenizer(out, vocab_size, chat_template, added_tokens)
    config.update(tokenizer_ids)
    if "text_config" in config:  # a multimodal wrapper: the language model reads these there
        config["text_config"] = {**config["text_config"], **tokenizer_ids}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(out, config, seed)
    return out


def _write_weights(out: Path, config: dict[str, Any], seed: int) -> None:
    """Random weights for `config` as mlx-lm initializes its model class (found by mlx-lm's
    model module, as its `load` does), scaled by `WEIGHT_SCALE`, in float32. The class is built
    directly: `load_model` would run the model's `sanitize` on no weights, which some
    models (Gemma 3n) cannot."""
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {
        k: _trained_like(k, (v * WEIGHT_SCALE).astype(mx.float32))
        for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


# Random recurrent layers forget within a few tokens (mlx-lm initializes state-space decays
# A = 1..N per step, so a token's trace is gone after a handful): trained models keep context
# for hundreds. These decays (A about 0.05, time steps about 0.05) let a token 100 positions
# back still move the logits, so a corrupted recurrent state is seen.
_SLOW_DECAY_A = 0.05
_SMALL_TIME_STEP_BIAS = -3.0  # softplus(-3) = 0.049
# RecurrentGemma's RG-LRU decays by exp(-8 gate softplus(p)) per step: p = -5.5 keeps about
# 0.98 per token (Griffin's trained range), where mlx-lm's p = 0 keeps 0.06.
_RG_LRU_PARAM = -5.5
# RWKV-7 decays by exp(-0.61 sigmoid(w)) per step: w = -5 keeps 0.996 per token (trained
# RWKV-7 models start w near -6), where a random w keeps about 0.74.
_RWKV_DECAY_BIAS = -5.0


def _trained_like(name: str, value: mx.array) -> mx.array:
    """`value`, or a trained-like replacement: slow decays for recurrent layers, and random
    values for matrices mlx-lm initializes to zeros because a checkpoint always overwrites
    them (routers, RWKV-7's per-head mixing and output norm, RecurrentGemma's convolution and
    gates, Talkie's output head). Left at zero, those switch their layer off: every expert
    ties, or a recurrent layer passes nothing on, and the model is blind to its context."""
    if name.endswith("A_log"):
        return mx.full(value.shape, math.log(_SLOW_DECAY_A), dtype=value.dtype)
    if name.endswith(("dt_bias", "dt_proj.bias")):
        return mx.full(value.shape, _SMALL_TIME_STEP_BIAS, dtype=value.dtype)
    if name.endswith("recurrent_param"):
        return mx.full(value.shape, _RG_LRU_PARAM, dtype=value.dtype)
    if name.endswith("w_lora.lora.2.bias"):
        return mx.full(value.shape, _RWKV_DECAY_BIAS, dtype=value.dtype)
    if value.ndim >= 2 and not mx.any(value).item():
        scale = 1 / math.sqrt(value.shape[-1])
        return (mx.random.normal(value.shape) * scale).astype(value.dtype)
    return value


def build_scripted_model(out_dir: str | Path, script: Sequence[str]) -> Path:
    """Writes a llama that answers every chat with `script`, then EOS, when sampled greedily:
    a generation tests control (tool calls, stop strings) through the real model code.

    Each piece of `script` becomes one token of its own. Every layer's output projections are
    zero, so the logits depend on the current token alone, and the LM head maps the last token
    of the generation prompt to the first piece, each piece to the next, the last to EOS. The
    template is `TOOLS_CHAT_TEMPLATE`.

    Args:
        out_dir: directory to create.
        script: the answer, in pieces of printable ASCII without spaces; no piece repeats.

    Raises:
        ValueError: pieces that repeat or are empty.
    """
    if len(set(script)) != len(script) or not all(script):
        raise ValueError("script pieces must be distinct and non-empty")
    out = build_model(
        "llama", out_dir, chat_template=TOOLS_CHAT_TEMPLATE, added_tokens=tuple(script)
    )
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    config = json.loads((out / "config.json").read_text())
    chain = [tokenizer.encode("<|im_start|>assistant\n").ids[-1]]
    chain += [tokenizer.token_to_id(piece) for piece in script] + [config["eos_token_id"]]
    weights = dict(mx.load(str(out / "model.safetensors")))
    for name, value in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(value)
    embed, norm = weights["model.embed_tokens.weight"], weights["model.norm.weight"]
    normed = embed * mx.rsqrt(mx.mean(embed * embed, axis=-1, keepdims=True)) * norm
    head = mx.zeros_like(weights["lm_head.weight"])
    for current, following in itertools.pairwise(chain):
        head[following] = 10.0 * normed[current] / mx.sum(normed[current] * normed[current])
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def _write_tokenizer(
    out: Path, vocab_size: int, chat_template: str, added_tokens: Sequence[str]
) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tokenizer.add_tokens(list(added_tokens))
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return {
        "vocab_size": max(vocab_size, tokenizer.get_vocab_size()),
        "eos_token_id": tokenizer.token_to_id("<|im_end|>"),
        "bos_token_id": tokenizer.token_to_id("<|endoftext|>"),
    }
