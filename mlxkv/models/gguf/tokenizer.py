"""The tokenizer of a GGUF file, rebuilt for Hugging Face's `tokenizers`.

Owns: checking that the file's tokenizer can be rebuilt (`check_tokenizer`) and writing
`tokenizer.json` and `tokenizer_config.json` from its `tokenizer.ggml.*` metadata
(`write_tokenizer`): byte-level BPE with llama.cpp's pre-tokenizer regexes, control tokens as
special tokens, the chat template. Does not own reading the file (`reader`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from mlxkv.errors import UnsupportedFormatError

logger = logging.getLogger(__name__)

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


def check_tokenizer(metadata: dict[str, Any], name: str) -> None:
    """Refuses, before any weight is converted, a tokenizer `write_tokenizer` cannot build."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedFormatError(
            f"{name}: GGUF tokenizer model {kind!r} is not supported; only byte-level BPE "
            "('gpt2', as in SmolLM2, Llama 3 and Qwen GGUFs). SentencePiece ('llama') files "
            "such as Llama 2 or Mistral GGUFs cannot be converted"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise UnsupportedFormatError(f"{name}: GGUF metadata has no tokenizer.ggml.tokens")


def write_tokenizer(metadata: dict[str, Any], out: Path) -> None:
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
    pre = metadata.get("tokenizer.ggml.pre", "default")
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
        index = metadata.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "chat_template": metadata.get("tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
