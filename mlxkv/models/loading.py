"""Loading a model and its tokenizer from wherever `sources` finds it.

Owns: `LoadedModel`, `load_model` and `materialize`. Delegates architectures, weights and
tokenizers to mlx-lm; adds clear errors that say what was tried and how to fix it. On MLX's
CPU backend, floating-point weights are cast to float32, the fast dtype there.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import gemma2

from mlxkv.errors import ModelLoadError, UnsupportedFormatError
from mlxkv.models import gguf
from mlxkv.models.encoder import EncoderModel, is_encoder_model, load_encoder
from mlxkv.models.gguf.reader import tensor_elements
from mlxkv.models.sharding import shard_model
from mlxkv.models.sources import default_model_path, find_model, is_gguf
from mlxkv.models.vision import VisionSupport, is_vision_model, load_vision_model
from mlxkv.platform.machine import on_gpu

logger = logging.getLogger(__name__)

# Most layers a config may say: the deepest released models have under 200.
MAX_LAYERS = 4096


@dataclass
class LoadedModel:
    """A model ready to run. `tokenizer` is mlx-lm's TokenizerWrapper; `vision` is None for
    a model that takes no images."""

    model: nn.Module
    tokenizer: Any
    config: dict[str, Any]
    path: Path
    vision: VisionSupport | None = None
    source_name: str | None = None  # what the caller named, where `path` is not it (a GGUF)

    @property
    def name(self) -> str:
        """The model's name in messages: what it was loaded as (a converted GGUF's `path` is
        a folder named by a digest), else its directory's name."""
        return self.source_name or self.path.name

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or len(self.tokenizer.vocab))

    @property
    def is_encoder(self) -> bool:
        """An encoder embedding model (`encoder`): it embeds, it does not generate."""
        return isinstance(self.model, EncoderModel)

    @property
    def max_position_embeddings(self) -> int | None:
        value = self.config.get("max_position_embeddings")
        return int(value) if value else None


def load_model(
    path_or_repo: str | Path | None = None,
    *,
    progress: gguf.ProgressCallback | None = None,
    group: mx.distributed.Group | None = None,
) -> LoadedModel:
    """Loads a model, converting a GGUF file (once; the result is cached) if given one.

    Args:
        path_or_repo: a directory in Hugging Face layout, a .gguf file, an Ollama model name
            ("smollm2:135m"), a Hugging Face repo id, or None for the default model.
        progress: called as progress(done, total) in tensors while converting a GGUF file.
        group: shard the model over this process group (see `sharding.shard_model`);
            the weights are loaded lazily, so each rank reads only its shard into memory.

    Raises:
        ModelLoadError: nothing loadable there (the message says what was tried and the fix).
        UnsupportedFormatError: a GGUF of an unsupported architecture or tensor type.
        NotSupportedError: `group` is given and the architecture cannot be sharded.
    """
    path = find_model(default_model_path() if path_or_repo is None else str(path_or_repo))
    if not (path.suffix == ".gguf" or is_gguf(path)):
        return _load_directory(path, group)
    source_name = path.name if path_or_repo is None else Path(str(path_or_repo)).name
    converted = gguf.converted_dir(path, progress=progress)
    try:
        return _load_directory(converted, group, source_name)
    except ModelLoadError as error:
        if _machine_failed(error.__cause__):  # nothing wrong with the conversion: keep it
            raise
        # its files have their sizes but not their bytes (changed in place): the conversion
        # cache is ours, so convert again once rather than fail on every run from now on
        logger.warning(
            "gguf: conversion at %s does not load (%s); converting again", converted, error
        )
        gguf.drop_conversion(converted)
        again = gguf.converted_dir(path, progress=progress)
        try:
            return _load_directory(again, group, source_name)
        except ModelLoadError:  # the file itself converts to no model: keep nothing of it
            gguf.drop_conversion(again)
            raise


# A load that fails for these says nothing about the files (out of memory, of open files,
# of disk): a conversion is kept for them, not converted again. MLX says it in its messages
# only (allocators on Metal and CUDA; opening a weights file, which is there: `is_conversion`
# checked it), matched by their own words, never by a path they may quote.
_MACHINE_ERRNOS = frozenset({errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC})
_MACHINE_MESSAGES = (
    "[malloc]",
    "[metal::malloc]",
    "[malloc_async]",
    "cudaMallocManaged failed",
    "[load_safetensors] Failed to open",
)


def _machine_failed(error: BaseException | None) -> bool:
    """True for a load failure of the machine, not of the model's files: an OSError of
    `_MACHINE_ERRNOS`, or a RuntimeError of MLX's saying so (a corrupt safetensors header is
    a RuntimeError too)."""
    if isinstance(error, OSError):
        return error.errno in _MACHINE_ERRNOS
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _MACHINE_MESSAGES)


def _load_directory(
    path: Path, group: mx.distributed.Group | None, source_name: str | None = None
) -> LoadedModel:
    """`load_model` for a model directory (`source_name`: the GGUF file it was converted from)."""
    from mlx_lm.utils import load

    if not path.is_dir():  # a file that is not GGUF: say so, not mlx-lm's errno
        raise ModelLoadError(
            f"could not load a model from {path}: it is a file, neither a model directory "
            "(config.json and weights) nor a .gguf file"
        )
    config = _read_config(path)
    _check_depth(path, config)
    if group is None and is_vision_model(config):
        return _load_vision(path, config)
    if is_encoder_model(config):
        model, tokenizer = load_encoder(path, config)
        return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path)
    try:
        model, tokenizer, config = load(str(path), return_config=True, lazy=group is not None)
    # mlx-lm builds the model from whatever config.json and tokenizer.json say: a zero, a
    # string or a huge number there fails inside it as a TypeError or an ArithmeticError
    except (ValueError, KeyError, OSError, RuntimeError, TypeError, ArithmeticError) as error:
        where = source_name or path  # a GGUF's conversion is ours, its name means nothing
        raise ModelLoadError(f"could not load a model from {where}: {_one_line(error)}") from error
    if group is not None:
        kind = shard_model(model, group, config.get("model_type", "?"), config)
        logger.info("sharded model kind=%s ranks=%d rank=%d", kind, group.size(), group.rank())
    if not on_gpu():
        model.set_dtype(mx.float32)  # half-precision matmuls are several times slower on CPU
    _fix_batch_masks(model)
    materialize(model)
    logger.info("loaded model path=%s type=%s", path, config.get("model_type"))
    return LoadedModel(
        model=model, tokenizer=tokenizer, config=config, path=path, source_name=source_name
    )


class _Gemma2Attention(gemma2.Attention):
    """mlx-lm's Gemma 2 attention, reading a batch's mask row by row (`_fix_batch_masks`)."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if isinstance(mask, mx.array) and mask.ndim == 4:
            mask = mx.expand_dims(mask, 2)  # (B, 1, 1, L, S): each row's own mask
        return super().__call__(x, mask, cache)


def _fix_batch_masks(model: nn.Module) -> None:
    """Gemma 2's attention made to read a batch's mask row by row: mlx-lm's adds a
    (B, 1, L, S) mask to its (B, kv heads, repeats, L, S) scores, which puts row b's mask on
    KV head b (ml-explore/mlx-lm#1903, open): a batch of rows answered otherwise than each
    row alone, so Gemma 2 decoded one stream at a time (`probe_batched_decode`). Only where
    the installed mlx-lm's attention still does (`_misreads_batch_masks`): its own fix, once
    it lands, is left as it is."""
    attentions = [
        module
        for _, module in model.named_modules()
        if type(module) is gemma2.Attention and module.repeats > 1
    ]
    if attentions and _misreads_batch_masks(attentions[0]):
        for attention in attentions:
            attention.__class__ = _Gemma2Attention


def _misreads_batch_masks(attention: gemma2.Attention) -> bool:
    """Whether `attention` answers a row of a batch otherwise than that row alone, under a
    (B, 1, L, S) mask of the rows' own (or fails on one). A misread moves the row by about its
    own scale; rounding (reduced-precision matmuls on a GPU) by far less. A probe that fails
    otherwise says no: the load's batched-decode probe still keeps a misreading model exact."""
    hidden = attention.o_proj.weight.shape[0]
    x = mx.random.normal((2, 2, hidden), key=mx.random.key(0))
    mask = mx.array([[[[True, True], [True, True]]], [[[True, False], [True, False]]]])
    try:
        together = gemma2.Attention.__call__(attention, x, mask)
        alone = gemma2.Attention.__call__(attention, x[1:], mask[1:])
    except ValueError:  # the shapes do not broadcast: the mask's rows met the heads
        return True
    except Exception as error:  # an mlx-lm this probe does not know
        logger.info("gemma2 mask probe failed (%s): its attention left as it is", error)
        return False
    scale = max(1.0, mx.abs(alone).max().item())
    return mx.abs(together[1:] - alone).max().item() > 1e-2 * scale


def _one_line(error: Exception, max_chars: int = 300) -> str:
    """mlx-lm's error on one line and cut short: its "Missing 269 parameters" lists every
    name on a line of its own."""
    text = " ".join(str(error).split())
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _check_depth(path: Path, config: dict[str, Any]) -> None:
    """Refuse a layer count no model has: mlx-lm builds every layer's module before it reads
    a weight, so `num_hidden_layers: 10**9` would hang the load (and `mlxkv info`) for ever."""
    for where in (config, config.get("text_config") or {}):
        layers = where.get("num_hidden_layers") if isinstance(where, dict) else None
        if isinstance(layers, int) and layers > MAX_LAYERS:
            raise ModelLoadError(
                f"could not load a model from {path}: its config.json says num_hidden_layers="
                f"{layers:,}, more than any model has ({MAX_LAYERS:,}); fix the config"
            )


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # mlx-lm's load says what is missing
    if not isinstance(config, dict):  # UnsupportedFormatError: a server lists its other models
        raise UnsupportedFormatError(
            f"could not load a model from {path}: its config.json holds a JSON"
            f" {type(config).__name__}, not an object"
        )
    return config


def _load_vision(path: Path, config: dict[str, Any]) -> LoadedModel:
    """A vision-language model through mlx-vlm: mlx-lm would load some of these as text
    models, dropping the vision tower and M-RoPE."""
    model, tokenizer, vision = load_vision_model(path, config)
    if not on_gpu():
        model.set_dtype(mx.float32)
    materialize(model)
    # the language model's settings, named by the whole model's type (gemma3, not gemma3_text)
    text_config = {**config, **config.get("text_config", {}), "model_type": config["model_type"]}
    logger.info("loaded vision model path=%s type=%s", path, config.get("model_type"))
    return LoadedModel(
        model=model, tokenizer=tokenizer, config=text_config, path=path, vision=vision
    )


def materialize(model: nn.Module) -> None:
    """Evaluates every array the model holds, private ones (e.g. RoPE frequencies) included.

    MLX streams belong to the thread that made them: a lazy array left here (the float32 cast
    above is lazy) would fail with "There is no Stream(cpu, 0) in current thread" the first
    time another thread runs the model.
    """
    mx.eval([leaf for _, leaf in tree_flatten(model) if isinstance(leaf, mx.array)])


# safetensors dtypes `load_model` casts to float32 on the CPU backend (mlx's set_dtype: floats)
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def expected_weights_bytes(model: str | Path | None) -> int:
    """The bytes a local model's weights take once `load_model` has loaded them, read from its
    files' headers (no weights read): the bytes on disk understate them on MLX's CPU backend,
    which casts floating-point weights to float32, and for a GGUF file, whose quantized tensors
    are dequantized (to float16, float32 on the CPU). 0 for a model that is not a local file or
    directory (a repo id, an Ollama name: unknown until it loads).

    Raises:
        UnsupportedFormatError: a GGUF file whose tensor table, a safetensors file whose
            header, or a config.json that is not a JSON object, cannot be read.
    """
    path = Path(model).expanduser() if model else None
    if path is None or not path.exists():
        return 0
    float_bytes = None if on_gpu() else 4
    if is_gguf(path):
        return tensor_elements(path) * (float_bytes or 2)
    tied = path.is_dir() and _ties_embeddings(_read_config(path))
    return sum(_safetensors_bytes(file, float_bytes, tied) for file in _weight_files(path))


def _ties_embeddings(config: dict[str, Any]) -> bool:
    """Whether the config says the output head is the embedding: a checkpoint that still
    stores `lm_head` has it dropped by the loader (mlx-lm's and mlx-vlm's `sanitize`). Only a
    config that says so: where it is silent, the default differs per architecture."""
    text = config.get("text_config") or {}
    return config.get("tie_word_embeddings", text.get("tie_word_embeddings")) is True


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files the loader of `path`'s model reads, no others (a repo's
    `consolidated.safetensors` beside them is another copy): mlx-vlm's `*.safetensors`,
    mlx-embeddings' `model*.safetensors` in any folder (else `weight*`), mlx-lm's
    `model*.safetensors`."""
    if path.is_file():
        return [path]
    config = _read_config(path)
    if is_vision_model(config):
        return sorted(path.glob("*.safetensors"))
    if is_encoder_model(config):
        nested = sorted(path.glob("**/model*.safetensors"))
        return nested or sorted(path.glob("weight*.safetensors"))
    return sorted(path.glob("model*.safetensors"))


def _safetensors_bytes(file: Path, float_bytes: int | None, tied: bool) -> int:
    """A safetensors file's tensors' bytes once loaded, floats at `float_bytes` each (None: as
    stored), from its JSON header (8 bytes of length, then the header); with `tied`, without
    the `lm_head` tensors the loader drops (`_ties_embeddings`).

    Raises:
        UnsupportedFormatError: a header that cannot be read (a file cut short).
    """
    try:
        with file.open("rb") as handle:
            (header_bytes,) = struct.unpack("<Q", handle.read(8))
            if header_bytes > file.stat().st_size:
                raise ValueError(f"a header of {header_bytes} bytes")
            header = json.loads(handle.read(header_bytes))
        total = 0
        for name, tensor in header.items():
            if name == "__metadata__" or (tied and name.split(".")[-2:-1] == ["lm_head"]):
                continue
            start, end = tensor["data_offsets"]
            floating = float_bytes is not None and tensor["dtype"] in _FLOAT_DTYPES
            total += math.prod(tensor["shape"]) * float_bytes if floating else end - start
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as error:
        raise UnsupportedFormatError(f"{file} is not a valid safetensors file: {error}") from None
    return total
