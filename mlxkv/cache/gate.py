"""Layers a model may use only once each is ready: a cache restored while it is still being
checked (the disk tier's streamed restore), layer by layer.

Owns the `LayerGate` protocol and `GatedLayers`, the list of layers a model is called with
while a gate is open (`ModelCache.forward`). Does not own what makes a layer ready (the disk
tier's `mlxkv.runner.disk.reading.LayerStream`) or what a broken one costs (the request
prefills again from what the disk restores without it: `mlxkv.runner.prompt_cache.pool`).

Why at the model's call: a prefill after a restore needs layer i's K/V of every restored token
before it computes layer i, and not before. The model asks for layer i's cache just before it
computes layer i, so that is where the gate waits; before waiting it starts MLX computing what
the layers before hold (`mx.async_eval`), so compute overlaps the reads of later layers.

Invariant: nothing evaluates a gated layer's arrays before `wait` of its index returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx

from mlxkv.cache.layer_ops import arrays_of


class LayerGate(Protocol):
    """Says when each layer of a restored cache may be used."""

    def ready(self, index: int) -> bool:
        """True when layer `index` passed its check (a wait would not block)."""

    def wait(self, index: int) -> None:
        """Returns once layer `index` may be used.

        Raises:
            RestoreBroken: it, or a layer before it, failed its check.
        """

    def wait_all(self) -> None:
        """`wait` for every layer."""


class GatedLayers(Sequence):
    """`layers` as the model indexes and iterates them, each handed out only once `gate`
    says it is ready; while waiting, what the layers before it were given is computed."""

    def __init__(self, layers: list[Any], gate: LayerGate, num_gated: int | None = None):
        self._layers = layers
        self._gate = gate
        self._num_gated = len(layers) if num_gated is None else num_gated  # the rest: padding

    def __len__(self) -> int:
        return len(self._layers)

    def __add__(self, other: list[Any]) -> GatedLayers:
        """The layers, still gated, then `other`'s items as they are: Gemma 4 pads the cache
        list it is given for its KV-shared layers (`cache + [None] * k`), as a list allows."""
        if not isinstance(other, list):
            return NotImplemented
        return GatedLayers(self._layers + other, self._gate, self._num_gated)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self._layers))[index]]
        if not -len(self._layers) <= index < len(self._layers):
            raise IndexError(index)  # ends iteration (Sequence.__iter__)
        index %= len(self._layers)
        if index >= self._num_gated:
            return self._layers[index]
        if index > 0 and not self._gate.ready(index):
            mx.async_eval(arrays_of(self._layers[index - 1]))
        self._gate.wait(index)
        return self._layers[index]
