"""GGUF (llama.cpp's format) to an mlx-lm model directory, converted once and reused.

Owns: reading a GGUF file with `mx.load(path, return_metadata=True)`, checking its
architecture and tensor types, mapping llama.cpp tensor names to mlx-lm's, undoing llama.cpp's
row permutation of the q and k projections, building the config from metadata, rebuilding the
byte-level BPE tokenizer (`tokenizer.ggml.*`) with `tokenizers`, and caching the result in a
user cache directory keyed by the file's content hash.

Weights are dequantized and stored as float16; `loading` casts them to the fast dtype of the
device (float32 on MLX's CPU backend, where quantized matmuls are ~40x slower).

Supported: architecture `llama`; file types F32, F16, Q4_0, Q4_1, Q8_0 (group size 32).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxkv import config
from mlxkv.errors import ModelLoadError, UnsupportedFormatError
from mlxkv.models.gguf.header import check_gguf

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]

# general.file_type values (llama.cpp's `llama_ftype`) whose tensors `mx.load` can read.
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0"}
_SUPPORTED_ARCHITECTURES = ("llama",)
_GROUP_SIZE = 32  # every supported GGUF block type packs 32 weights per block

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), by `tokenizer.ggml.pre`.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    "default": [_GPT2_REGEX],
    "gpt2": [_GPT2_REGEX],
    "smollm": [r"\p{N}", _GPT2_REGEX],
    "starcoder": [r"\p{N}", _GPT2_REGEX],
    "llama-bpe": [_LLAMA3_REGEX],
    "llama3": [_LLAMA3_REGEX],
}
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_MANIFEST = "mlxkv-conversion.json"  # file name -> size in bytes, written last


def default_cache_root() -> Path:
    """The parent of converted models' `gguf/` directory: `mlxkv.config.cache_root()`.

    Raises:
        ModelLoadError: MLXKV_CACHE_DIR names something that is not a directory.
    """
    try:
        return config.cache_root()
    except ValueError as error:
        raise ModelLoadError(str(error)) from error


def converted_dir(
    gguf_path: str | Path,
    *,
    cache_root: Path | None = None,
    progress: ProgressCallback | None = None,
) -> Path:
    """The mlx-lm directory for a GGUF file, converting it on first use.

    A conversion found in the cache is reused only if its files have the sizes recorded when
    it was written; otherwise (truncated, half deleted) it is converted again.

    Args:
        gguf_path: the .gguf file.
        cache_root: parent of converted models (default `default_cache_root()`).
        progress: called as progress(done, total) in tensors while converting.

    Raises:
        UnsupportedFormatError: not a valid llama-architecture GGUF of a supported tensor type.
        ModelLoadError: no such file, or the cache directory cannot be written.
    """
    path = _checked_source(Path(gguf_path))
    out = (cache_root or default_cache_root()) / "gguf" / _content_hash(path)
    if is_conversion(out):
        logger.info("gguf: reusing conversion of %s at %s", path.name, out)
        return out
    if out.exists():
        logger.warning("gguf: conversion at %s is incomplete or corrupt; converting again", out)
        shutil.rmtree(out, ignore_errors=True)  # the cache directory is ours
    logger.info("gguf: converting %s to %s", path.name, out)
    return convert_gguf(path, out, progress=progress)


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, progress: ProgressCallback | None = None
) -> Path:
    """Writes the model in `gguf_path` to `out_dir` in Hugging Face layout (mlx-lm loads it).

    Everything checkable (header, metadata, tokenizer, tensor names) is checked before any
    weight is converted. Files are written to a temporary directory of this process beside
    `out_dir`, which is renamed into place at the end: the directory appears complete or not
    at all, an error leaves nothing behind, and two processes converting at once do not
    collide. `out_dir` may be new, empty, or an earlier conversion; anything else is refused,
    never deleted.

    Raises:
        UnsupportedFormatError: the file is not a valid, supported GGUF.
        ModelLoadError: `gguf_path` is not a file, or `out_dir` is a file, a non-empty
            directory that is not a conversion, or cannot be written.
    """
    path = _checked_source(Path(gguf_path))
    out = Path(out_dir)
    _check_destination(out)
    check_gguf(path)
    try:
        tensors, metadata = mx.load(str(path), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError) as error:
        raise UnsupportedFormatError(f"{path.name}: MLX could not read it: {error}") from error
    config = _config(metadata, tensors, path.name)
    _check_tokenizer(metadata, path.name)
    for name in tensors:
        _target_name(name.rsplit(".", 1)[0])
    tmp = _temporary_dir(out)
    try:
        weights = _weights(tensors, config, progress)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _write_tokenizer(metadata, tmp)
        _write_manifest(tmp, path.name)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_conversion(directory: Path) -> bool:
    """True when `directory` holds a complete conversion: every file the manifest lists, at
    the size it had when written."""
    try:
        manifest = json.loads((directory / _MANIFEST).read_text())
        return all((directory / n).stat().st_size == size for n, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _checked_source(path: Path) -> Path:
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not a GGUF file")
    if not path.is_file():
        raise ModelLoadError(f"no GGUF file at {path}")
    return path


def _check_destination(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ModelLoadError(f"{out} is a file; give a new or empty directory to convert into")
    if out.is_dir() and any(out.iterdir()) and not (out / _MANIFEST).exists():
        raise ModelLoadError(
            f"{out} is not empty and is not an mlxkv conversion; nothing was written. Give a "
            "new or empty directory"
        )


def _temporary_dir(out: Path) -> Path:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as error:
        raise ModelLoadError(
            f"cannot write a conversion in {out.parent} ({error.strerror or error}); choose a "
            "writable directory (for the conversion cache: set MLXKV_CACHE_DIR)"
        ) from error


def _write_manifest(directory: Path, source: str) -> None:
    files = {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}
    manifest = {"format": 1, "source": source, "files": files}
    (directory / _MANIFEST).write_text(json.dumps(manifest, indent=2))


def _move_into_place(tmp: Path, out: Path) -> None:
    """Renames `tmp` to `out`; an earlier conversion there is replaced. If another process
    put a complete conversion there first, that one is kept and `tmp` is dropped."""
    old = None
    if out.is_dir():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        if not is_conversion(out):
            raise
        logger.info("gguf: another process finished the conversion at %s first", out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _content_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()[:24]


def _scalar(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def _config(metadata: dict[str, Any], tensors: dict[str, mx.array], name: str) -> dict[str, Any]:
    arch = _scalar(metadata, "general.architecture")
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise UnsupportedFormatError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(_SUPPORTED_ARCHITECTURES)}"
        )
    file_type = _scalar(metadata, "general.file_type")
    if file_type is not None and file_type not in _FILE_TYPES:
        raise UnsupportedFormatError(
            f"GGUF file type {file_type} is not supported; supported: "
            f"{', '.join(_FILE_TYPES.values())}. Use a Q8_0, Q4_0, Q4_1 or F16 file"
        )
    if "rope_freqs.weight" in tensors:
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
        "num_key_value_heads": _scalar(metadata, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _scalar(metadata, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": _scalar(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _scalar(metadata, f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": _scalar(metadata, f"{arch}.vocab_size", len(tokens)),
        "max_position_embeddings": _scalar(metadata, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _scalar(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(metadata, "tokenizer.ggml.eos_token_id"),
        "source_gguf_file_type": _FILE_TYPES.get(file_type, "unknown"),
    }


def _positive_int(metadata: dict[str, Any], key: str, name: str) -> int:
    value = _scalar(metadata, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UnsupportedFormatError(
            f"{name}: GGUF metadata {key} is {'missing' if value is None else repr(value)}; "
            "a llama model needs a positive integer there"
        )
    return value


def _check_tokenizer(metadata: dict[str, Any], name: str) -> None:
    """Refuses, before any weight is converted, a tokenizer `_write_tokenizer` cannot build."""
    kind = _scalar(metadata, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedFormatError(
            f"{name}: GGUF tokenizer model {kind!r} is not supported; only byte-level BPE "
            "('gpt2', as in SmolLM2, Llama 3 and Qwen GGUFs). SentencePiece ('llama') files "
            "such as Llama 2 or Mistral GGUFs cannot be converted"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise UnsupportedFormatError(f"{name}: GGUF metadata has no tokenizer.ggml.tokens")


def _weights(
    tensors: dict[str, mx.array], config: dict[str, Any], progress: ProgressCallback | None
) -> dict[str, mx.array]:
    bases = sorted({name.rsplit(".", 1)[0] for name in tensors})
    weights = {}
    for done, base in enumerate(bases, start=1):
        target, kind = _target_name(base)
        weight = _dequantized(tensors, base)
        if kind == "attn_q":
            weight = _unpermute_rows(weight, config["num_attention_heads"])
        elif kind == "attn_k":
            weight = _unpermute_rows(weight, config["num_key_value_heads"])
        weights[f"{target}.weight"] = weight.astype(mx.float16)
        mx.eval(weights[f"{target}.weight"])
        if progress:
            progress(done, len(bases))
    return weights


def _target_name(base: str) -> tuple[str, str]:
    if base in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[base], base
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}", parts[2]
    raise UnsupportedFormatError(f"GGUF tensor {base!r} has no mlx-lm llama counterpart")


def _dequantized(tensors: dict[str, mx.array], base: str) -> mx.array:
    weight = tensors[f"{base}.weight"]
    scales = tensors.get(f"{base}.scales")
    if scales is None:
        return weight
    bits = weight.shape[-1] // scales.shape[-1]
    return mx.dequantize(
        weight, scales, tensors[f"{base}.biases"], group_size=_GROUP_SIZE, bits=bits
    )


def _unpermute_rows(weight: mx.array, num_heads: int) -> mx.array:
    """Undoes llama.cpp's convert-time permutation of q/k rows (interleaved RoPE pairs back
    to Hugging Face's half-split layout). Shape (num_heads * head_dim, in) is unchanged."""
    rows, cols = weight.shape
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, cols)
        .swapaxes(1, 2)
        .reshape(rows, cols)
    )


def _write_tokenizer(metadata: dict[str, Any], out: Path) -> None:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tokenizer = Tokenizer(bpe)
    pre = _scalar(metadata, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        logger.warning("gguf: unknown pre-tokenizer %r; using GPT-2's", pre)
    splits = [
        pre_tokenizers.Split(Regex(r), behavior="isolated")
        for r in _PRE_TOKENIZERS.get(pre, [_GPT2_REGEX])
    ]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = np.array(metadata.get("tokenizer.ggml.token_type", np.ones(len(tokens))))
    special = [t for t, k in zip(tokens, types, strict=True) if k == _TOKEN_TYPE_CONTROL]
    added = [t for t, k in zip(tokens, types, strict=True) if k == _TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in added])
    tokenizer.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = _scalar(metadata, key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_scalar(metadata, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "chat_template": _scalar(metadata, "tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
