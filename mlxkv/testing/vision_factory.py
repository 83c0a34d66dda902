"""Small vision-language models with random weights, built offline for tests and benchmarks.

Owns: writing a Qwen2-VL, Qwen2.5-VL, Gemma 3 or SmolVLM directory in Hugging Face layout
(`config.json` with its `vision_config`, `model.safetensors`, a tokenizer holding the family's
vision tokens and chat template, `preprocessor_config.json` sized so a 56x56 image is a
handful of tokens) that `mlx_vlm.load` and `mlxkv.Runner.load` read like a downloaded model.
Weights come from mlx-vlm's own model class, so the vision tower, the merger or projector and
M-RoPE are the real code. Does not own: loading (`mlxkv.models.vision`), nor text models
(`factory`).

Imports mlx-vlm (the `vision` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxkv.testing.factory import CHAT_TEMPLATE, _write_tokenizer
from mlxkv.testing.tiny_attention import BASE_CONFIG

# Qwen2-VL's own markers: an image is <|vision_start|> <|image_pad|> x N <|vision_end|>.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# ChatML where content may be a list of parts, as Qwen2-VL's template renders them.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Patches of 14 pixels merged 2x2: a 56x56 image is a 4x4 grid, 4 tokens; up to 112x112.
_PREPROCESSOR = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}

# Per size: text config overrides, vision config overrides, the largest image in pixels.
_SIZES: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    "tiny": ({}, {}, 112 * 112),
    "small": (
        {
            "hidden_size": 512,
            "num_hidden_layers": 8,
            "intermediate_size": 1408,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
        },
        {"depth": 4, "embed_dim": 256, "hidden_size": 512, "num_heads": 4},
        448 * 448,
    ),
}

# Per family, what its config adds to Qwen2-VL's: Qwen2.5-VL's vision tower has windowed
# attention blocks (the tiny one's only block attends fully), a gated MLP and its own output
# width. The tiny vision sizes, scaled with "small" as for Qwen2-VL where they matter. Gemma 3
# and SmolVLM are built by their own functions below (other layouts, tokens and templates).
_QWEN: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"architectures": ["Qwen2VLForConditionalGeneration"]},
    "qwen2_5_vl": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "window_size": 112,
            "fullatt_block_indexes": [0],
        },
    },
}

# Gemma 3's turns and image markers; <start_of_image> is what its template writes per image.
_GEMMA_TOKENS = [
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
_GEMMA_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# SmolVLM's markers: a tile is <fake_token_around_image><row_R_col_C><image> x N, the whole
# image <fake_token_around_image><global-img><image> x N<fake_token_around_image>.
_SMOLVLM_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
_SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}:{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# Idefics3 (SmolVLM v1 checkpoints) is SmolVLM's layout under its own names.
_TILED = {
    "smolvlm": ("SmolVLM", "smolvlm_vision"),
    "idefics3": ("Idefics3", "idefics3_vision"),
}

FAMILIES = (*_QWEN, "qwen3_vl", "gemma3", *_TILED)

# Larger than the text factory's scale: the image must change the greedy answer
# (tests/runner/vision/test_vision.py checks two images give two answers).
WEIGHT_SCALE = 2.0
# Weights mlx-vlm initializes to a constant, drawn at random instead (as a trained model's
# are): Gemma 3's projection is ones, which sums each image row's LayerNorm'd (zero-mean)
# features to 0 in exact arithmetic, so the float32 rows were rounding noise (about 1e-6,
# changed by the batch the encoder ran in) and the answers depended on that noise.
_DRAWN_AT_RANDOM = ("multi_modal_projector.mm_input_projection_weight",)


# A SigLIP-style tower (Gemma 3's, SmolVLM's, Idefics3's): one layer, a 56-pixel image of
# 14-pixel patches (16 patches).
_TINY_VISION_TOWER = {
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "patch_size": 14,
    "image_size": 56,
}


def noise_images(seed: int, shapes: list[tuple[int, int, int]]) -> list[Any]:
    """PIL images of uniform noise, one per (height, width, channels), drawn in order from one
    generator seeded with `seed` (the same images for the same arguments): random pixels, so
    that two images never encode alike by chance."""
    from PIL import Image  # with mlx-vlm, as the rest of this module

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in shapes]


def noise_image(seed: int, shape: tuple[int, int, int] = (56, 56, 3)) -> Any:
    """One image of `noise_images`: the first that `seed` draws."""
    return noise_images(seed, [shape])[0]


def build_vision_model(
    out_dir: str | Path,
    *,
    family: str = "qwen2_vl",
    size: str = "tiny",
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """Writes a random-weight vision-language model of one of `FAMILIES`.

    Args:
        out_dir: directory to create (parents too); existing files in it are overwritten.
        family: one of `FAMILIES` (the model_type).
        size: "tiny" (tests: 2 text layers of width 64, 1 vision block; 56x56 to 112x112
            images) or, for Qwen only, "small" (benchmarks: 8 layers of width 512, 4 vision
            blocks; up to 448x448, 256 tokens).
        vocab_size: tokens in the trained tokenizer (the vision tokens come after them).
        seed: seeds the weights.

    Returns:
        The directory, ready for `mlx_vlm.load` or `mlxkv.Runner.load`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if family not in FAMILIES or size not in _SIZES or (size != "tiny" and family not in _QWEN):
        raise ValueError(
            f"unknown size {size!r} or family {family!r}; choose a family of "
            f"{', '.join(FAMILIES)} and a size of {', '.join(_SIZES)} (Qwen only: small)"
        )
    writers = {"qwen3_vl": _write_qwen3, "gemma3": _write_gemma3}
    write = {**writers, **dict.fromkeys(_TILED, _write_tiled)}.get(family, _write_qwen)
    config = write(out, family, size, vocab_size)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(out, config, seed)
    return out


def _write_qwen(out: Path, family: str, size: str, vocab_size: int) -> dict[str, Any]:
    ids = _write_tokenizer(out, vocab_size, VISION_CHAT_TEMPLATE, ())
    token_ids = _add_special_tokens(out, VISION_TOKENS)
    # mlx-vlm's detokenizer indexes its table by every id the head can pick: no spare rows
    config = _config({**ids, "vocab_size": max(token_ids.values()) + 1})
    text, vision, max_pixels = _SIZES[size]
    config.update(text, model_type=family, architectures=_QWEN[family]["architectures"])
    config["vision_config"].update(vision if family == "qwen2_vl" else {})
    config["vision_config"].update(_QWEN[family].get("vision_config", {}))
    config.update(
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
    )
    preprocessor = {**_PREPROCESSOR, "max_pixels": max_pixels}
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return config


def _write_qwen3(out: Path, family: str, size: str, vocab_size: int) -> dict[str, Any]:
    """Qwen3-VL: 16-pixel patches merged 2x2 (a 56x56 image is resized to 64x64: 4 tokens),
    Qwen's markers and template, one deepstack level (from the first of 2 vision blocks)."""
    qwen2 = _write_qwen(out, "qwen2_vl", size, vocab_size)
    text = {
        **BASE_CONFIG,
        "model_type": family,
        "vocab_size": qwen2["vocab_size"],
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]},
    }
    vision = {
        "model_type": family,
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
    }
    preprocessor = {**_PREPROCESSOR, "patch_size": 16, "min_pixels": 64 * 64}
    preprocessor.update(max_pixels=128 * 128, image_processor_type="Qwen3VLImageProcessor")
    preprocessor.update(processor_class="Qwen3VLProcessor")
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    keep = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return {
        "model_type": family,
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "vocab_size": qwen2["vocab_size"],
        "eos_token_id": qwen2["eos_token_id"],
        **{key: qwen2[key] for key in keep},
    }


def _write_gemma3(out: Path, family: str, size: str, vocab_size: int) -> dict[str, Any]:
    """Gemma 3: a 56x56 SigLIP input of 4x4 patches pooled 2x2 into 4 image tokens;
    every other text layer a sliding window shorter than the tests' second turns."""
    ids = _write_tokenizer(out, vocab_size, _GEMMA_TEMPLATE, ())
    token_ids = _add_special_tokens(out, _GEMMA_TOKENS)
    named = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    _set_tokenizer_config(out, eos_token="<end_of_turn>", extra_special_tokens=named)
    vocab = max(token_ids.values()) + 1
    text = {
        **BASE_CONFIG,
        "model_type": "gemma3_text",
        "vocab_size": vocab,
        "query_pre_attn_scalar": 16,
        "sliding_window": 32,
        "sliding_window_pattern": 2,
        "mm_tokens_per_image": 4,
    }
    vision = {**_TINY_VISION_TOWER, "model_type": "siglip_vision_model"}
    preprocessor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "size": {"height": 56, "width": 56},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pan_and_scan": False,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": 4}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return {
        "model_type": family,
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "vocab_size": vocab,
        "hidden_size": 64,
        "image_token_index": token_ids["<image_soft_token>"],
        "boi_token_index": token_ids["<start_of_image>"],
        "eoi_token_index": token_ids["<end_of_image>"],
        "pad_token_id": ids["bos_token_id"],  # <|endoftext|>, which no prompt holds
        "eos_token_id": token_ids["<end_of_turn>"],
    }


def _write_tiled(out: Path, family: str, size: str, vocab_size: int) -> dict[str, Any]:
    """SmolVLM or Idefics3: an image resized to 112 pixels on its longest side and split into
    56x56 tiles of 4x4 patches, each pixel-shuffled 2x2 into 4 tokens (a square image: 2x2
    tiles and the whole, 5 runs of 4 tokens)."""
    _write_tokenizer(out, vocab_size, _SMOLVLM_TEMPLATE, ())
    token_ids = _add_special_tokens(out, _SMOLVLM_TOKENS)
    _set_tokenizer_config(out, eos_token="<end_of_utterance>")
    vocab = max(token_ids.values()) + 1
    text = {**BASE_CONFIG, "model_type": "llama", "vocab_size": vocab}
    name, vision_type = _TILED[family]
    vision = {**_TINY_VISION_TOWER, "model_type": vision_type}
    preprocessor = {
        "image_processor_type": f"{name}ImageProcessor",
        "processor_class": f"{name}Processor",
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": 56},
        "size": {"longest_edge": 112},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    processor = {"processor_class": f"{name}Processor", "image_seq_len": 4}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return {
        "model_type": family,
        "architectures": [f"{name}ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "vocab_size": vocab,
        "scale_factor": 2,
        "image_token_id": token_ids["<image>"],
        "eos_token_id": token_ids["<end_of_utterance>"],
    }


def _set_tokenizer_config(out: Path, **settings: Any) -> None:
    path = out / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}, indent=2))


def _config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "model_type": "qwen2_vl",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        # head_dim 16: 8 rotary frequencies split over (time, height, width)
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        **ids,
    }


def _add_special_tokens(out: Path, tokens: list[str]) -> dict[str, int]:
    """Adds `tokens` to the tokenizer as special (control) tokens; returns their ids."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_special_tokens(tokens)
    tokenizer.save(str(out / "tokenizer.json"))
    return {t: tokenizer.token_to_id(t) for t in tokens}


def _write_weights(out: Path, config: dict[str, Any], seed: int) -> None:
    """Random weights as mlx-vlm's model class initializes them, scaled, in float32."""
    import importlib

    from mlx_vlm.utils import update_module_configs

    family = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    config = json.loads(json.dumps(config))  # from_dict changes it in place
    model_config = family.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, family, config, ["text", "vision"])
    mx.random.seed(seed)
    model = family.Model(model_config)
    weights = dict(tree_flatten(model.parameters()))
    for name in _DRAWN_AT_RANDOM:
        if name in weights:
            shape = weights[name].shape  # (inputs, outputs): unit variance out
            weights[name] = mx.random.normal(shape) / shape[0] ** 0.5
    weights = {k: (v * WEIGHT_SCALE).astype(mx.float32) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


__all__ = ["CHAT_TEMPLATE", "VISION_CHAT_TEMPLATE", "build_vision_model"]
