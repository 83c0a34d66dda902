"""Vision-language models through mlx-vlm: loading, the vision encoder's output cache, and the
language model called the way mlxkv calls every model (`model(ids, cache=layers)`).

Owns: `is_vision_model` (a config mlx-vlm must load), `load_vision_model`, `VisionSupport`
(the processor, the family's image handling, the encoder), `EncoderCache` (a Runner's encoder
outputs by image digest, counted in its byte budget) and `VisionLanguageModel` (the language
model with explicit positions) with its per-request form `ImagePrompt`. Does not own
rendering messages into token ids (`mlxkv.runner.text.vision`) nor
the prompt cache: it only reads the cache's offset.

Terms:
  - placeholder id: the id an image's tokens carry in a prompt's token record:
    `PLACEHOLDER_BASE` + 31 bits of the image's digest, past every vocabulary. The prompt cache
    matches records token by token, so the same image matches itself and a different image
    stops the match before its first placeholder; the model never embeds these ids (the
    encoder's output takes their place).
  - M-RoPE: Qwen-VL's positions are (time, height, width) triples; an image's tokens sit on a
    grid, so the text after an image is not at its token index. A prompt's positions are a
    function of its tokens and image grids up to each token, so a cached prefix keeps the
    positions a fresh run gives it; positions are always passed explicitly (mlx-vlm's
    language models otherwise keep position state between calls).
  - position shift: how far the positions of the tokens after a prompt run ahead of their
    index (its images' M-RoPE delta; 0 without images or M-RoPE). A reply decoding in a
    batch is at its row's cache offset plus its shift.

mlx-vlm is imported only here, and only when a vision model loads (the `vision` extra).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxkv.models.vision_families import FAMILIES, Deepstack, ImageFamily, ProcessedImage

logger = logging.getLogger(__name__)

PLACEHOLDER_BASE = 1 << 31
# Architectures loaded through mlx-vlm (their checkpoints hold a vision tower).
VISION_MODEL_TYPES = tuple(FAMILIES)
# The most images one prompt may hold.
MAX_IMAGES_PER_PROMPT = 16
# Any text id: where a prompt's positions are computed, it stands for a vision id the model
# generated (the family's position function reads nothing else of the text).
_TEXT_ID = 0


def is_vision_model(config: dict[str, Any]) -> bool:
    """Whether a model's config.json describes a vision-language model mlxkv loads through
    mlx-vlm."""
    return config.get("model_type") in VISION_MODEL_TYPES and "vision_config" in config


def placeholder_id(digest: str) -> int:
    """The id an image's tokens carry in the token record (see the module's terms)."""
    return PLACEHOLDER_BASE + int(digest[:8], 16) % PLACEHOLDER_BASE


@dataclass(frozen=True, kw_only=True)
class ImageSpan:
    """One image's place in a prompt.

    Attributes:
        start: index of its first token in the prompt (its expansion's first feature token).
        num_tokens: tokens from `start` to its last feature token (text between runs included).
        digest: its pixels' digest (`images.DecodedImage.digest`).
        processed: the processor's output for it (`vision_families.ProcessedImage`).
        runs: (start, length) of each run of feature tokens in the prompt, in order; the
            encoder's rows fill them in that order.
    """

    start: int
    num_tokens: int
    digest: str
    processed: ProcessedImage
    runs: tuple[tuple[int, int], ...]

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class VisionSupport:
    """What a vision-language model adds to a text model: its processor, its family's image
    handling and the vision encoder.

    Args:
        vlm: mlx-vlm's model (vision tower + language model).
        processor: mlx-vlm's processor for it (image processor and tokenizer).
    """

    def __init__(self, vlm: nn.Module, processor: Any):
        self.vlm = vlm
        self.processor = processor
        self.family = FAMILIES[vlm.config.model_type](vlm, processor)
        self.image_token_id = self.family.image_token_id
        self.encoder_runs = 0  # vision-encoder calls (one per image not in a cache)


class EncoderCache:
    """A Runner's vision-encoder outputs by image digest, least recently used dropped first
    past `max_bytes`; its bytes count inside the Runner's cache budget (the pool reads
    `nbytes`, from any thread). Filled on the engine thread only.

    Args:
        support: the model's vision support (its encoder).
        max_bytes: the most bytes kept (`mlxkv.config.encoder_cache_bytes`).
    """

    def __init__(self, support: VisionSupport, max_bytes: int):
        self.support = support
        self.max_bytes = max_bytes
        self._features: OrderedDict[str, mx.array] = OrderedDict()
        self._nbytes = 0  # kept as a sum: the memory report reads it from other threads

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def features(self, span: ImageSpan) -> mx.array:
        """The encoder's output for an image, (levels, feature tokens, hidden) (see
        `ImageFamily.encode`): from the cache by digest, else encoded now and kept within
        `max_bytes`."""
        cached = self._features.get(span.digest)
        if cached is not None:
            self._features.move_to_end(span.digest)
            return cached
        features = self.support.family.encode(span.processed)
        mx.eval(features)
        self.support.encoder_runs += 1
        logger.debug("vision encoder ran digest=%s rows=%d", span.digest[:12], features.shape[1])
        self._features[span.digest] = features
        self._nbytes += features.nbytes
        while self._nbytes > self.max_bytes and self._features:
            self._nbytes -= self._features.popitem(last=False)[1].nbytes
        return features


@dataclass(frozen=True)
class RowInputs:
    """One row's inputs to the language model for one call.

    Attributes:
        embeds: (1, L, hidden) token embeddings, the encoder's rows over image tokens.
        positions: (3, 1, L) M-RoPE positions; None for a family with plain positions.
        deep: the call's deepstack rows (Qwen3-VL), None when it feeds none.
    """

    embeds: mx.array
    positions: mx.array | None
    deep: Deepstack | None


class VisionLanguageModel(nn.Module):
    """mlx-vlm's language model called as mlxkv calls every model: `model(ids, cache=layers)`
    with text ids only (for M-RoPE, positions 1-D in all three axes: what a text-only prompt
    gets). A prompt with images runs through `ImagePrompt` instead."""

    def __init__(self, vlm: nn.Module, family: ImageFamily):
        super().__init__()
        self.vlm = vlm
        self._family = family

    @property
    def layers(self) -> list[nn.Module]:
        return self.vlm.layers

    def make_cache(self) -> list[Any]:
        """mlx-lm's caches in the layout of mlx-vlm's own (sliding-window layers for Gemma 3),
        which mlxkv's cache building knows."""
        from mlx_lm.models import cache as lm_cache

        from mlxkv.errors import NotSupportedError

        make = getattr(self.vlm.language_model, "make_cache", None)
        layers = []
        for layer in make() if make else [None] * len(self.layers):
            kind = type(layer).__name__
            if layer is None or kind == "KVCache":
                layers.append(lm_cache.KVCache())
            elif kind == "RotatingKVCache":
                layers.append(lm_cache.RotatingKVCache(layer.max_size, keep=layer.keep))
            else:
                raise NotSupportedError(f"a vision model's {kind} layers are not handled yet")
        return layers

    def __call__(
        self,
        inputs: mx.array,
        cache: Sequence[Any] | None = None,
        position_shifts: mx.array | None = None,
    ) -> mx.array:
        """Logits for text ids `inputs` (B, L) after what `cache` holds.

        Args:
            cache: the layers; a decode batch's (`BatchKVCache`) hold one offset per row.
            position_shifts: (B,) per row, how far its M-RoPE positions run ahead of its
                cache offset (a prompt with images: its last position + 1 minus its length;
                `ImagePrompt.position_shift`); None: none does. Ignored by families with
                plain positions (their language model reads each row's offset itself).
        """
        positions = None
        if self._family.uses_positions:
            positions = _call_positions(cache, inputs.shape[1], position_shifts)
        return self.run(self.embed(inputs), inputs, cache, positions)

    def row_inputs(self, inputs: mx.array, offset: int) -> RowInputs:
        """The language model's inputs for text ids `inputs` (1, L) after `offset` tokens: a
        text prompt's row of a batch fed with prompts with images (`PromptRows`)."""
        positions = None
        if self._family.uses_positions:
            positions = _text_positions(offset, inputs.shape[1])
        return RowInputs(self.embed(inputs), positions, None)

    def embed(self, ids: mx.array) -> mx.array:
        """Token embeddings; placeholder ids embed as token 0 (their rows are replaced)."""
        return self._family.embed(mx.where(ids >= PLACEHOLDER_BASE, 0, ids))

    def run(
        self, embeds: mx.array, ids: mx.array, cache: Any, positions: Any, deep: Any = None
    ) -> mx.array:
        return self._family.logits(ids, embeds, cache, positions, deep)


class ImagePrompt:
    """A vision model bound to one prompt with images: called like the model, it splices the
    encoder's output over each image's feature tokens and, for M-RoPE, gives the prompt's
    positions (after the prompt: the last position plus one per token). The encoder runs only
    for an image whose tokens a call feeds (not for images in a reused prefix).

    Args:
        model: the vision model.
        encoder: the Runner's encoder-output cache (`EncoderCache`).
        prompt: the prompt's token record (placeholder ids in the images' places).
        spans: the images, in order.
    """

    def __init__(
        self,
        model: VisionLanguageModel,
        encoder: EncoderCache,
        prompt: Sequence[int],
        spans: Sequence[ImageSpan],
    ):
        self.model = model
        self.encoder = encoder
        self.support = encoder.support
        self.spans = list(spans)
        self._prompt = list(prompt)
        self._positions: mx.array | None = None  # (3, 1, prompt tokens), made on first call
        self._delta = 0

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    @property
    def prompt(self) -> list[int]:
        """The token record of the prompt it is bound to."""
        return list(self._prompt)

    def rebind(self, prompt: Sequence[int], spans: Sequence[ImageSpan]) -> None:
        """Binds it to another prompt (a reply's prompt cut at message boundaries, fed again
        from an empty cache): its images and positions from then on."""
        self.spans = list(spans)
        self._prompt = list(prompt)
        self._positions = None

    def make_cache(self) -> list[Any]:
        return self.model.make_cache()

    def __call__(self, inputs: mx.array, cache: Sequence[Any] | None = None) -> mx.array:
        row = self.row_inputs(inputs, _offset(cache))
        return self.model.run(row.embeds, inputs, cache, row.positions, row.deep)

    def row_inputs(self, inputs: mx.array, offset: int) -> RowInputs:
        """The language model's inputs for ids `inputs` (1, L) fed after `offset` tokens of
        the prompt: their embeddings with the encoder's rows over the images' feature tokens
        the call feeds, and their positions."""
        length = inputs.shape[1]
        embeds = self.model.embed(inputs)
        pieces, deep, fed, at = [], [], [], offset
        for span in self.spans:
            row = 0
            for run_start, run_length in span.runs:
                start, end = max(run_start, offset), min(run_start + run_length, offset + length)
                if start < end:
                    pieces += [embeds[:, at - offset : start - offset]] if start > at else []
                    first = row + start - run_start
                    rows = self.encoder.features(span)[:, first : first + end - start]
                    pieces.append(rows[:1].astype(embeds.dtype))
                    deep.append(rows[1:])
                    fed.extend(range(start - offset, end - offset))
                    at = end
                row += run_length
        if pieces:
            pieces.append(embeds[:, at - offset :])
            embeds = mx.concatenate(pieces, axis=1)
        positions = None
        if self.support.family.uses_positions:
            positions = self._positions_at(offset, length)
        return RowInputs(embeds, positions, _deepstack(deep, fed, length))

    @property
    def position_shift(self) -> int:
        """How far the positions of the tokens after the prompt run ahead of their index (the
        M-RoPE shift its images make; 0 for plain positions): what a decode batch adds to
        this prompt's row offset (`VisionLanguageModel`'s `position_shifts`)."""
        if not self.support.family.uses_positions:
            return 0
        return self._kept_positions()[1]

    def _positions_at(self, offset: int, length: int) -> mx.array:
        prompt_positions, delta = self._kept_positions()
        total = len(self._prompt)
        parts = []
        if offset < total:
            parts.append(prompt_positions[:, :, offset : min(total, offset + length)])
        if offset + length > total:
            first = max(offset, total)
            parts.append(_text_positions(first + delta, offset + length - first))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def _kept_positions(self) -> tuple[mx.array, int]:
        """`_prompt_positions`, computed on first use and kept until `rebind`."""
        if self._positions is None:
            self._positions, self._delta = self._prompt_positions()
        return self._positions, self._delta

    def _prompt_positions(self) -> tuple[mx.array, int]:
        """The prompt's M-RoPE positions (the family's, from mlx-vlm's own `get_rope_index`)
        and the shift of the tokens after it (their position minus their index). A prompt
        left with no image (a reply's cut past the last one) has a text prompt's positions."""
        if not self.spans:
            return _text_positions(0, len(self._prompt)), 0
        ids = np.array(self._prompt, dtype=np.int64)
        # A vision id in the record is one the model generated (a reply sent back with its
        # ids), which its decode placed as text: only the placeholders are images' tokens.
        ids[np.isin(ids, self.support.family.vision_ids())] = _TEXT_ID
        ids[ids >= PLACEHOLDER_BASE] = self.support.image_token_id
        inputs = [span.processed.inputs for span in self.spans]
        return self.support.family.prompt_positions(ids, inputs)


def _deepstack(deep: list[mx.array], fed: list[int], length: int) -> Deepstack | None:
    """The call's deepstack rows (Qwen3-VL), or None: no image rows fed, or a family
    without deepstack levels."""
    if not deep or deep[0].shape[0] == 0:
        return None
    mask = np.zeros((1, length), dtype=bool)
    mask[0, fed] = True
    rows = mx.concatenate(deep, axis=1)  # (levels, image tokens fed, hidden)
    return Deepstack(mx.array(mask), [rows[level] for level in range(rows.shape[0])])


def _offset(cache: Sequence[Any] | None) -> int:
    return 0 if not cache else int(cache[0].offset)


def _call_positions(cache: Sequence[Any] | None, length: int, shifts: mx.array | None) -> mx.array:
    """The (3, B, L) M-RoPE positions of a call of text tokens: from the cache's offset, or,
    for a decode batch's layers (an offset per row, left padding not counted), from each
    row's own offset plus its shift."""
    offset = cache[0].offset if cache else 0
    if not isinstance(offset, mx.array):
        return _text_positions(int(offset), length)
    first = offset if shifts is None else offset + shifts  # (B,)
    positions = first[:, None] + mx.arange(length)[None]  # (B, L)
    return mx.broadcast_to(positions[None], (3, *positions.shape))


def _text_positions(first: int, length: int) -> mx.array:
    positions = mx.arange(first, first + length).reshape(1, 1, length)
    return mx.broadcast_to(positions, (3, 1, length))


def load_vision_model(path: Path, config: dict[str, Any]) -> tuple[nn.Module, Any, VisionSupport]:
    """Loads a vision-language model with mlx-vlm (its own processor and chat template): the
    model mlxkv calls, mlx-lm's tokenizer wrapper, and the vision support.

    Raises:
        ModelLoadError: mlx-vlm is not installed, or cannot load the directory.
    """
    from mlxkv.errors import ModelLoadError

    try:
        from mlx_vlm.utils import load as vlm_load
    except ImportError:
        raise ModelLoadError(
            f"{path} is a vision-language model ({config.get('model_type')}); install the "
            "vision extra to run it: pip install 'mlxkv[vision]'"
        ) from None
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    try:
        vlm, processor = vlm_load(str(path))
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (ValueError, FileNotFoundError, KeyError, OSError) as error:
        raise ModelLoadError(f"could not load a vision model from {path}: {error}") from error
    if getattr(tokenizer, "chat_template", None) is None:
        # mlx-lm's wrapper hands the attribute to the tokenizer it wraps
        tokenizer.chat_template = getattr(processor, "chat_template", None)
    support = VisionSupport(vlm, processor)
    return VisionLanguageModel(vlm, support.family), tokenizer, support
