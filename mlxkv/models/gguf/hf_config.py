"""The Hugging Face `config.json` of a llama GGUF file, built from its metadata.

Owns: which architectures and llama.cpp file types convert (`SUPPORTED_ARCHITECTURES`,
`FILE_TYPES`) and mapping `<arch>.*` metadata to mlx-lm's llama config (`hf_config`). Does not
own reading the file (`reader`) or the tokenizer (`tokenizer`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from mlxkv.errors import UnsupportedFormatError

# general.file_type values (llama.cpp's `llama_ftype`) whose tensors `mx.load` can read.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0"}
SUPPORTED_ARCHITECTURES = ("llama",)


def hf_config(metadata: dict[str, Any], tensor_names: Collection[str], name: str) -> dict[str, Any]:
    """The `config.json` of the model in a GGUF file (metadata as `reader.read_metadata`
    returns it; `tensor_names` as MLX names the tensors; `name` for messages).

    Raises:
        UnsupportedFormatError: an architecture or file type that is not supported, or
            llama metadata that is missing or not a positive integer.
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedFormatError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    file_type = metadata.get("general.file_type")
    if file_type is not None and file_type not in FILE_TYPES:
        raise UnsupportedFormatError(
            f"GGUF file type {file_type} is not supported; supported: "
            f"{', '.join(FILE_TYPES.values())}. Use a Q8_0, Q4_0, Q4_1 or F16 file"
        )
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedFormatError(
            "GGUF with a rope_freqs tensor (Llama 3.1-style RoPE scaling) is not supported yet"
        )
    size = {
        key: _positive_int(metadata, f"{arch}.{key}", name)
        for key in ("embedding_length", "block_count", "feed_forward_length")
    }
    heads = _positive_int(metadata, f"{arch}.attention.head_count", name)
    hidden = size["embedding_length"]
    if f"{arch}.attention.key_length" not in metadata and hidden % heads:
        raise UnsupportedFormatError(
            f"{name}: embedding_length {hidden} is not a multiple of head_count {heads}"
        )
    tokens = metadata.get("tokenizer.ggml.tokens", [])
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": size["block_count"],
        "intermediate_size": size["feed_forward_length"],
        "num_attention_heads": heads,
        "num_key_value_heads": metadata.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": metadata.get(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": metadata.get(f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": metadata.get(f"{arch}.vocab_size", len(tokens)),
        "max_position_embeddings": metadata.get(f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "source_gguf_file_type": FILE_TYPES.get(file_type, "unknown"),
    }


def _positive_int(metadata: dict[str, Any], key: str, name: str) -> int:
    value = metadata.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UnsupportedFormatError(
            f"{name}: GGUF metadata {key} is {'missing' if value is None else repr(value)}; "
            "a llama model needs a positive integer there"
        )
    return value
