"""What differs between the vision-language families mlxkv runs through mlx-vlm.

Owns: `ImageFamily` (one per loaded model, chosen by `model_type`): the text the chat template
writes for an image (its marker), the processor's expansion of that marker for one image (the
text holding the image's feature tokens: one run for Qwen-VL and Gemma 3, one run per tile and
one for the whole image, with text between, for Idefics3/SmolVLM), the encoder's output rows for
those tokens, and how the language model is called (explicit M-RoPE positions for Qwen-VL,
plain cache offsets for the others). Does not own the encoder cache, the prompt's token record
nor splicing rows into a call (`mlxkv.models.vision`).

Imported only when a vision model loads (it uses mlx-vlm's model and processor objects).
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass(frozen=True)
class ProcessedImage:
    """One image through the model's processor.

    Attributes:
        text: what replaces the template's marker for it (the processor's own expansion).
        inputs: the processor's arrays for the encoder (pixel values and the family's extras).
        num_features: the encoder's output rows: the image tokens in `text`.
    """

    text: str
    inputs: dict[str, np.ndarray]
    num_features: int


class ImageFamily(abc.ABC):
    """A family whose encoder rows are what mlx-vlm's own `get_input_embeddings` puts over
    the image tokens (Gemma 3 scales them; Idefics3 drops all-zero padding tiles): the rows are
    taken from its output on the image's expansion alone, so they are the library's, exactly.

    Args:
        vlm: mlx-vlm's model.
        processor: mlx-vlm's processor for it.
    """

    uses_positions = False  # whether the language model takes explicit (M-RoPE) positions

    def __init__(self, vlm: nn.Module, processor: Any):
        self.vlm = vlm
        self.processor = processor
        config = vlm.config
        image_token_id = getattr(config, "image_token_id", None) or config.image_token_index
        self.image_token_id = int(image_token_id)
        self.marker = processor.tokenizer.convert_ids_to_tokens(self.image_token_id)

    @abc.abstractmethod
    def process(self, image: Any) -> ProcessedImage:
        """One RGB image (PIL) through the processor."""

    def encode(self, processed: ProcessedImage) -> mx.array:
        """The encoder's rows for one image, (levels, num_features, hidden), unevaluated:
        level 0 replaces the image tokens' embeddings; levels 1.. are Qwen3-VL's deepstack
        rows, added after the first text layers."""
        ids = self.processor.tokenizer.encode(processed.text, add_special_tokens=False)
        ids = mx.array([ids])
        inputs = {k: mx.array(v) for k, v in processed.inputs.items()}
        pixels = inputs.pop("pixel_values")
        out = self.vlm.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape), **inputs)
        rows = mx.array(np.flatnonzero(np.array(ids[0]) == self.image_token_id))
        return out.inputs_embeds[0][rows][None]

    def embed(self, ids: mx.array) -> mx.array:
        language = self.vlm.language_model
        return getattr(language, "model", language).embed_tokens(ids)

    def logits(
        self, ids: mx.array, embeds: mx.array, cache: Any, positions: Any, deep: Any = None
    ) -> mx.array:
        """The language model's logits for one call; `deep` is the call's deepstack rows
        (`Deepstack`), None when it feeds none."""
        return self.vlm.language_model(ids, inputs_embeds=embeds, cache=cache).logits

    def prompt_positions(self, ids: np.ndarray, inputs: list[dict[str, np.ndarray]]) -> Any:
        return None

    def vision_ids(self) -> tuple[int, ...]:
        """The ids `prompt_positions` reads as an image's or a video's tokens (none here)."""
        return ()


class QwenVL(ImageFamily):
    """Qwen2-VL / Qwen2.5-VL: patches merged 2x2 into one run of `<|image_pad|>` tokens; the
    encoder is called directly (mlx-vlm's `get_input_embeddings` would also compute the
    expansion's M-RoPE positions); M-RoPE positions from mlx-vlm's own `get_rope_index`."""

    uses_positions = True

    def process(self, image: Any) -> ProcessedImage:
        out = self.processor.image_processor(images=[image])
        grid = np.asarray(out["image_grid_thw"]).reshape(1, 3).astype(np.int64)
        merge = int(self.vlm.config.vision_config.spatial_merge_size)
        count = int(np.prod(grid)) // merge**2
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        inputs = {"pixel_values": pixels, "image_grid_thw": grid}
        return ProcessedImage(self.marker * count, inputs, count)

    def encode(self, processed: ProcessedImage) -> mx.array:
        tower = self.vlm.vision_tower
        pixels = mx.array(processed.inputs["pixel_values"])
        pixels = pixels.astype(tower.patch_embed.proj.weight.dtype)
        grid = mx.array(processed.inputs["image_grid_thw"])
        return tower(pixels, grid, output_hidden_states=False)[None]

    def logits(
        self, ids: mx.array, embeds: mx.array, cache: Any, positions: Any, deep: Any = None
    ) -> mx.array:
        out = self.vlm.language_model(ids, embeds, cache=cache, position_ids=positions)
        return out.logits

    def prompt_positions(self, ids: np.ndarray, inputs: list[dict[str, np.ndarray]]) -> Any:
        """The prompt's (3, 1, tokens) positions and the shift of the tokens after it."""
        grids = mx.array(np.concatenate([i["image_grid_thw"] for i in inputs]))
        language = self.vlm.language_model
        positions, deltas = language.get_rope_index(mx.array(ids[None].astype(np.int32)), grids)
        return positions, int(np.asarray(deltas).reshape(-1)[0])

    def vision_ids(self) -> tuple[int, ...]:
        """`get_rope_index` counts an image or a video at a vision start followed by its
        token's id, and places it at the next image or video token's id (a vision start is
        the template's own before an image: a reply is followed by the template's text)."""
        return (self.vlm.config.image_token_id, self.vlm.config.video_token_id)


@dataclass(frozen=True)
class Deepstack:
    """Qwen3-VL's deepstack rows for one call.

    Attributes:
        mask: (1, call tokens) bool, True where the call feeds an image token.
        rows: per deepstack level, (image tokens fed, hidden), in the mask's order.
    """

    mask: mx.array
    rows: list[mx.array]


class Qwen3VL(QwenVL):
    """Qwen3-VL: Qwen2-VL's layout (16-pixel patches) plus deepstack: the encoder also gives
    rows from some of its blocks that are added to the image tokens' hidden states after the
    first text layers."""

    def encode(self, processed: ProcessedImage) -> mx.array:
        tower = self.vlm.vision_tower
        pixels = mx.array(processed.inputs["pixel_values"])
        pixels = pixels.astype(tower.patch_embed.proj.weight.dtype)
        features, deepstack = tower(pixels, mx.array(processed.inputs["image_grid_thw"]))
        return mx.stack([features, *deepstack])

    def logits(
        self, ids: mx.array, embeds: mx.array, cache: Any, positions: Any, deep: Any = None
    ) -> mx.array:
        extra = (
            {}
            if deep is None
            else {"visual_pos_masks": deep.mask, "deepstack_visual_embeds": deep.rows}
        )
        out = self.vlm.language_model(ids, embeds, cache=cache, position_ids=positions, **extra)
        return out.logits


class Gemma3(ImageFamily):
    """Gemma 3: the template writes `<start_of_image>`, which the processor expands to
    `\\n\\n<start_of_image>` + `<image_soft_token>` x image_seq_length + `<end_of_image>\\n\\n`;
    one run, plain positions (mlx-vlm's own generation runs its causal, windowed masks)."""

    def __init__(self, vlm: nn.Module, processor: Any):
        super().__init__(vlm, processor)
        self.marker = processor.boi_token

    def process(self, image: Any) -> ProcessedImage:
        out = self.processor.image_processor(images=[image])
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        processor = self.processor
        count = int(processor.image_seq_length)
        return ProcessedImage(processor.full_image_sequence, {"pixel_values": pixels}, count)


class Idefics3(ImageFamily):
    """Idefics3 and SmolVLM: an image larger than a tile is split into rows x cols tiles plus
    the whole image downscaled, each its own run of `<image>` tokens behind a
    `<row_R_col_C>` (or `<global-img>`) marker; plain positions."""

    def __init__(self, vlm: nn.Module, processor: Any):
        super().__init__(vlm, processor)
        # the processor module's own expansion (Idefics3's and SmolVLM's differ only in names)
        module = importlib.import_module(type(processor).__module__)
        self._expand = module.get_image_prompt_string
        self._fake = str(processor.fake_image_token)
        tag = getattr(processor, "global_image_token", None) or processor.global_image_tag
        self._global = str(tag)

    def process(self, image: Any) -> ProcessedImage:
        out = self.processor.image_processor([[image]], return_row_col_info=True)
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        seq = int(self.processor.image_seq_len)
        text = self._expand(rows, cols, seq, self._fake, self.marker, self._global)
        inputs = {
            "pixel_values": np.asarray(out["pixel_values"], dtype=np.float32),
            "pixel_attention_mask": np.asarray(out["pixel_attention_mask"]),
        }
        return ProcessedImage(text, inputs, seq * (rows * cols + 1))


FAMILIES: dict[str, type[ImageFamily]] = {
    "qwen2_vl": QwenVL,
    "qwen2_5_vl": QwenVL,
    "qwen3_vl": Qwen3VL,
    "gemma3": Gemma3,
    "smolvlm": Idefics3,
    "idefics3": Idefics3,
}
