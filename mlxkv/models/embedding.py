"""Embeddings from a decoder model: its last hidden states pooled into one unit vector per text.

Owns: `Embeddings` (the result), `Embedder` (input checks, truncation, the model's pooling),
`Pooling` (how a model's hidden states become one vector), `read_pooling` (which one a model
asks for) and `embed_batches` (token lists to unit vectors, several per forward pass). Does not
own tokenizing (the Runner's prompt encoder) or which thread runs the work (`runner`).
Embeddings neither read nor change a prompt cache: every text runs from its first token, as
its own sequence.

Terms: *hidden states* are what the model's body (`model.model` in mlx-lm) returns after its
final norm, before the output head; *pooling* turns a text's hidden states, one per token,
into one vector: its last token's ("lasttoken", Qwen3-Embedding's), the mean over its tokens,
or its first token's ("cls").

Batches pad each text on the right: attention is causal, so no real token sees the padding
and a text's vector in a batch equals its vector alone (up to the batched kernels' rounding).
"""

from __future__ import annotations

import json
import logging
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxkv.errors import ContextLengthError, ModelInputError, ModelNotSupportedError
from mlxkv.models.encoder import EncoderModel

if TYPE_CHECKING:
    from mlxkv.models.loading import LoadedModel

logger = logging.getLogger(__name__)

Pooling = Literal["lasttoken", "mean", "cls"]
# sentence-transformers' Pooling config keys, in the order one is taken when several are set.
_ST_MODES: tuple[tuple[str, Pooling], ...] = (
    ("pooling_mode_lasttoken", "lasttoken"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_cls_token", "cls"),
)
_ST_POOLING_TYPE = "sentence_transformers.models.Pooling"


EmbeddingInput = str | Sequence[int]


@dataclass(frozen=True)
class Embeddings:
    """Attributes:
    vectors: float32 (N, D): one unit vector per input, in the inputs' order.
    num_tokens: the tokens embedded, over every input (after any truncation).
    pooling: how each input's hidden states became its vector ("lasttoken", "mean", "cls").
    """

    vectors: np.ndarray
    num_tokens: int
    pooling: Pooling


class Embedder:
    """A loaded model's embeddings: its pooling read once, input checked before any model
    work, the model work handed to `call`.

    Args:
        loaded: the model; it must expose its hidden states (`hidden_states_of`), which is
            checked on the first call (a Runner of a model that cannot embed still generates).
        encode: a text or token ids to checked token ids (the Runner's prompt encoder).
        call: runs a function where the model's MLX work runs (the Runner's engine thread)
            and returns its result.
        max_tokens: most tokens of one input (the Runner's window).
        batch_tokens: most padded tokens per forward pass.
        name: the model's name in error messages.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        encode: Callable[[Any], list[int]],
        call: Callable[[Callable[[], np.ndarray]], np.ndarray],
        *,
        max_tokens: int,
        batch_tokens: int,
        name: str,
    ):
        self._loaded = loaded
        self._encode = encode
        self._call = call
        self._max_tokens = max_tokens
        self._batch_tokens = batch_tokens
        self._name = name
        self.pooling = read_pooling(loaded.path, encoder=loaded.is_encoder)

    def embed(
        self,
        inputs: EmbeddingInput | Sequence[EmbeddingInput],
        *,
        dimensions: int | None = None,
        truncate: bool = False,
    ) -> Embeddings:
        """See `Runner.embed`."""
        body = hidden_states_of(self._loaded.model, self._name)
        token_lists = [self._tokens(item, i, truncate) for i, item in enumerate(_listed(inputs))]
        hidden_size = int(self._loaded.config.get("hidden_size") or 0)
        _check_dimensions(dimensions, hidden_size, self._name)
        vectors = self._call(
            lambda: embed_batches(
                body,
                token_lists,
                self.pooling,
                batch_tokens=self._batch_tokens,
                dimensions=dimensions,
            )
        )
        num_tokens = sum(len(tokens) for tokens in token_lists)
        logger.debug("embedded inputs=%d tokens=%d", len(token_lists), num_tokens)
        return Embeddings(vectors=vectors, num_tokens=num_tokens, pooling=self.pooling)

    def _tokens(self, item: EmbeddingInput, index: int, truncate: bool) -> list[int]:
        if isinstance(item, str):
            if not item:
                raise ValueError(f"input {index} is an empty string; embed text with content")
            tokens = self._encode(item)
        elif isinstance(item, list | tuple) and item and all(_is_id(t) for t in item):
            tokens = self._encode(list(item))
        else:
            raise ValueError(
                f"input {index} must be a non-empty string or list of token ids; got "
                f"{type(item).__name__}"
            )
        if len(tokens) > self._max_tokens:
            if not truncate:
                raise ContextLengthError(
                    f"input {index} is {len(tokens):,} tokens; this model embeds at most "
                    f"{self._max_tokens:,} tokens per input (truncate it, or ask to truncate)",
                    prompt_tokens=len(tokens),
                    max_context=self._max_tokens,
                )
            tokens = tokens[: self._max_tokens]
        return tokens


def _listed(inputs: EmbeddingInput | Sequence[EmbeddingInput]) -> list[EmbeddingInput]:
    """One input (a string, or a flat list of token ids) as a list of one; a list as is."""
    if isinstance(inputs, bytes | bytearray | memoryview):
        raise ValueError("inputs are bytes; decode them to a str first (inputs.decode('utf-8'))")
    if isinstance(inputs, str) or (
        isinstance(inputs, Sequence) and inputs and all(_is_id(t) for t in inputs)
    ):
        return [inputs]  # type: ignore[list-item]
    if not isinstance(inputs, Sequence) or not inputs:
        raise ValueError("inputs must be a string, a list of strings, or lists of token ids")
    return list(inputs)


def _is_id(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_dimensions(dimensions: int | None, hidden_size: int, name: str) -> None:
    if dimensions is None:
        return
    if not _is_id(dimensions) or dimensions < 1 or (hidden_size and dimensions > hidden_size):
        raise ModelInputError(
            name,
            f"dimensions must be an integer from 1 to {hidden_size} (model '{{model}}' gives "
            f"{hidden_size}-dimensional embeddings); got {dimensions!r}",
        )


def read_pooling(path: Path, encoder: bool = False) -> Pooling:
    """The pooling a model directory asks for: its sentence-transformers config
    (`modules.json` naming a Pooling module) when there is one; else the mean for an encoder
    (mlx-embeddings' default), the last token for a decoder named as an embedding model
    (Qwen3-Embedding and its kind, trained on the last token's state), and the mean for any
    other (a chat model has no trained pooling; the mean is what Ollama gives for one)."""
    modules = _read_json(path / "modules.json")
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, dict) and module.get("type") == _ST_POOLING_TYPE:
            config = _read_json(path / str(module.get("path", "")) / "config.json") or {}
            for key, mode in _ST_MODES:
                if config.get(key):
                    return mode
            logger.warning("unsupported sentence-transformers pooling path=%s", path)
    return "lasttoken" if "embed" in path.name.lower() and not encoder else "mean"


def hidden_states_of(model: nn.Module, name: str) -> Callable[[mx.array, mx.array], mx.array]:
    """The model's final hidden states (B, L, D) for token ids (B, L) padded on the right and
    their lengths (B,): a decoder's body (causal: the padding is never seen), or an encoder's
    (`encoder.EncoderModel`: the padding masked).

    Raises:
        ModelNotSupportedError: the architecture has no such body in mlx-lm (`model.model`).
    """
    if isinstance(model, EncoderModel):
        return model.hidden_states
    body = getattr(model, "model", None)
    if not isinstance(body, nn.Module):
        kind = type(model).__module__.rsplit(".", 1)[-1]
        raise ModelNotSupportedError(
            name,
            f"model '{{model}}' ({kind}) cannot compute embeddings: its architecture does not "
            "expose hidden states; serve an embedding model or a transformer decoder",
        )
    return lambda tokens, lengths: body(tokens)


def embed_batches(
    body: Callable[[mx.array, mx.array], mx.array],
    token_lists: Sequence[Sequence[int]],
    pooling: Pooling,
    *,
    batch_tokens: int,
    dimensions: int | None = None,
) -> np.ndarray:
    """Unit vectors, one per token list, in their order; float32 (N, D), or (N, dimensions):
    the first `dimensions` components normalized again (Matryoshka truncation).

    Texts of similar lengths run together, at most `batch_tokens` padded tokens per forward
    pass (a longer text runs alone).
    """
    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    rows: dict[int, np.ndarray] = {}
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and len(token_lists[order[end]]) * (end + 1 - start) <= batch_tokens:
            end += 1
        batch = [token_lists[i] for i in order[start:end]]
        for i, row in zip(
            order[start:end], _embed_one_batch(body, batch, pooling, dimensions), strict=True
        ):
            rows[i] = row
        start = end
    return np.stack([rows[i] for i in range(len(token_lists))])


def _embed_one_batch(
    body: Callable[[mx.array, mx.array], mx.array],
    batch: Sequence[Sequence[int]],
    pooling: Pooling,
    dimensions: int | None,
) -> np.ndarray:
    lengths = mx.array([len(tokens) for tokens in batch])
    width = max(len(tokens) for tokens in batch)
    padded = mx.array([list(tokens) + [0] * (width - len(tokens)) for tokens in batch])
    hidden = body(padded, lengths).astype(mx.float32)  # (B, L, D)
    if pooling == "lasttoken":
        pooled = hidden[mx.arange(len(batch)), lengths - 1]
    elif pooling == "cls":
        pooled = hidden[:, 0]
    else:
        real = (mx.arange(width)[None, :] < lengths[:, None]).astype(mx.float32)  # (B, L)
        pooled = (hidden * real[..., None]).sum(axis=1) / lengths[:, None].astype(mx.float32)
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    norms = mx.linalg.norm(pooled, axis=-1, keepdims=True)
    return np.array(pooled / mx.maximum(norms, 1e-12), dtype=np.float32)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
