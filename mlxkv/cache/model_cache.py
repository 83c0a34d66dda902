"""ModelCache: a whole model's cache, one cache per layer plus the token ids they hold.

Owns: running the model on new tokens so that K/V and token ids always change together
(`forward`), and the management operations Ollama's cache interface has: trim to a length (all
or nothing), free, bytes. Building one for a model is `building.make_cache`.

Invariants:
  - the token list always has exactly as many entries as the tokens the layers have seen; a
    forward pass that raises (KeyboardInterrupt included) leaves both as they were;
  - all attention layers share one offset (== num_tokens), but for K/V layers the model
    never writes, which stay empty (`layer_ops.is_unwritten`);
  - `trim_to(n)` changes nothing unless every layer can go back to n (`can_trim_to`).
  - a layer restored while its check still runs (`gate`) reaches the model, or any
    evaluation, only once it passed (`mlxkv.cache.gate`);
  - after an in-place `shift`, the K/V past its `keep` approximate a prefill of the tokens
    (`shifted`) until the cache is trimmed back to the kept tokens or freed.

Recurrent state (mlx-lm's `ArraysCache`, maybe in a `CacheList`) is kept as it is and cannot
trim: `checkpoint()` snapshots it (and sliding windows) at the current length, `rewind_to(n)`
restores one, trimming the rest; `snapshot_for_disk()` takes one for the disk tier alone.
"""
# long: every operation here changes the token ids and the layers together (forward, trim,
# checkpoints, shift, copy); split apart, each would reach into the others' private state.

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.checkpoints import add_checkpoint, drop_checkpoints_after, snapshot_layers
from mlxkv.cache.footprint import Footprint, measure
from mlxkv.cache.gate import GatedLayers, LayerGate
from mlxkv.cache.layer_ops import (
    always_trimmable,
    arrays_of,
    copy_layer,
    is_unwritten,
    layer_can_trim,
    leaves,
    mark_layer,
    restore_layer,
)
from mlxkv.cache.layers.kv import KVCache, Rotation
from mlxkv.errors import CacheFullError, NotSupportedError, RestoreBroken

logger = logging.getLogger(__name__)


class ModelCache:
    """Per-layer caches of one model and the token ids whose K/V they hold.

    Models index it like mlx-lm's list of caches (`cache[i]`, `len(cache)`).

    Args:
        layers: one cache per model layer.
        make_layers: builds a fresh, empty list of layers; `free()` calls it.
        capacity_tokens: most tokens the cache may hold (the runner's context window); None
            for no limit. `forward` refuses a batch that would pass it.
    """

    def __init__(
        self,
        layers: list[Any],
        make_layers: Callable[[], list[Any]],
        capacity_tokens: int | None = None,
    ):
        self.layers = layers
        self._make_layers = make_layers
        self.capacity_tokens = capacity_tokens
        self._tokens: list[int] = []
        # Token ids fed after `_tokens`, in order, not yet read back: lazy arrays (pipelined
        # decoding) and the lists fed behind them, which must wait their turn.
        self._pending: list[mx.array | list[int]] = []
        self._num_pending = 0  # their count, kept so num_tokens is O(1) in the decode loop
        # num_tokens -> per-layer snapshot (None for layers that can simply trim back)
        self._checkpoints: dict[int, list[Any]] = {}
        # the disk tier's (`snapshot_for_disk`), by `forward` at multiples of this (None: none)
        self._disk_snapshots: dict[int, list[Any]] = {}
        self.snapshot_every_tokens: int | None = None
        # Layers restored while their checks still run (`mlxkv.cache.gate`): None once all
        # passed. A forward hands each layer to the model once it is ready; `arrays`,
        # `copy_prefix` and `shift` wait for all first.
        self.gate: LayerGate | None = None
        # Tokens at the start whose K/V a shift left exact (its `keep`); None: no shift since
        # they were last all exact. Deeper layers keep the later tokens' K/V computed with
        # the dropped tokens in context: those approximate a prefill of the tokens held.
        self._exact_tokens: int | None = None

    @property
    def shifted(self) -> bool:
        """True while some held tokens' K/V come from an in-place `shift` (approximate): not
        after trimming back to the tokens it kept, nor after `free`."""
        return self._exact_tokens is not None

    @property
    def exact_tokens(self) -> int | None:
        """While `shifted`, the tokens at the start whose K/V the shift left exact (None: all
        are): what the disk tier saves with the blocks, so a restore stays `shifted`."""
        return self._exact_tokens

    def __getitem__(self, index: int) -> Any:
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V (or recurrent state) the layers hold."""
        return len(self._tokens) + self._num_pending

    @property
    def tokens(self) -> list[int]:
        """The token ids held, oldest first (a copy)."""
        self._settle()
        return list(self._tokens)

    def _settle(self) -> None:
        for pending in self._pending:
            self._tokens.extend(pending.tolist() if isinstance(pending, mx.array) else pending)
        self._pending.clear()
        self._num_pending = 0

    def materialize(self) -> list[int]:
        """Evaluates every lazy array and reads back pending token ids; returns the token ids
        held, as `tokens` does. A lazy array built on one thread cannot be evaluated on
        another: materializing at the end of each request lets the next run on any thread."""
        mx.eval(self.arrays() + [p for p in self._pending if isinstance(p, mx.array)])
        return self.tokens

    def forward(self, model: nn.Module, token_ids: Sequence[int] | mx.array) -> mx.array:
        """Runs `model` on `token_ids` after the held tokens and records them as held.

        All or nothing: if the model raises, every layer is put back as it was.

        Args:
            model: an mlx-lm model, called as `model(ids[None], cache=layers)`.
            token_ids: 1-D token ids. An `mx.array` may still be lazy (decode pipelining):
                its values are read back only when `tokens` is next asked for.

        Returns:
            Logits (1, L, vocab), lazy.

        Raises:
            ValueError: token_ids is empty.
            CacheFullError: the batch does not fit in `capacity_tokens` (nothing changes).
        """
        is_array = isinstance(token_ids, mx.array)
        ids = token_ids if is_array else mx.array(list(token_ids), dtype=mx.uint32)
        if ids.size == 0:
            raise ValueError("forward needs at least one token id; got none")
        if self.capacity_tokens is not None and self.num_tokens + ids.size > self.capacity_tokens:
            raise CacheFullError(
                f"cannot add {ids.size} tokens to {self.num_tokens}: the cache holds at most "
                f"{self.capacity_tokens} tokens. Trim or shift it first, or raise max_context",
                self.capacity_tokens,
            )
        marks = [mark_layer(layer) for layer in self.layers]
        layers = self.layers if self.gate is None else GatedLayers(self.layers, self.gate)
        try:
            logits = model(ids.reshape(1, -1), cache=layers)
            if self.gate is not None:  # the layers the model did not ask for, too
                self.gate.wait_all()
                self.gate = None
        except BaseException:
            for layer, mark in zip(self.layers, marks, strict=True):
                restore_layer(layer, mark)
            raise
        if is_array or self._pending:  # a list behind ids not yet read back waits its turn
            self._pending.append(ids.reshape(-1) if is_array else [int(t) for t in token_ids])
            self._num_pending += ids.size
        else:
            self._tokens.extend(int(t) for t in token_ids)
        if self.snapshot_every_tokens and self.num_tokens % self.snapshot_every_tokens == 0:
            self.snapshot_for_disk()  # evaluates this pass: once a block, in decoding too
        return logits

    def feed(self, model: nn.Module, token_ids: Sequence[int]) -> None:
        """`forward` for tokens whose logits nobody reads (a prompt's, all but its last): evaluates
        the layers, not the logits, so MLX never runs the vocabulary projection (as mlx-lm)."""
        self.forward(model, token_ids)
        mx.eval(self.arrays())

    def forward_tentative(
        self, model: nn.Module, token_ids: Sequence[int]
    ) -> tuple[mx.array, Callable[[int], None]]:
        """`forward`, plus `keep(n)`, which afterwards keeps only the first n of these tokens
        (speculative decoding's rollback of rejected drafts). Where every layer can go back,
        keep trims, which is O(1); otherwise (recurrent state, a window that lost what it
        needs) the layers are put back as they were before this pass and the n tokens are
        fed again, so the state is always exactly what feeding n tokens gives. `keep` must be
        called before anything else changes the cache."""
        start = self.num_tokens
        marks = [mark_layer(layer) for layer in self.layers]
        logits = self.forward(model, token_ids)

        def keep(num_kept: int) -> None:
            if self.can_trim_to(start + num_kept):
                self.trim_to(start + num_kept)
                return
            for layer, saved in zip(self.layers, marks, strict=True):
                restore_layer(layer, saved)
            self._settle()
            del self._tokens[start:]
            self._forget_after(start)
            if num_kept:
                self.forward(model, token_ids[:num_kept])

        return logits, keep

    def can_trim_to(self, num_tokens: int) -> bool:
        """True when every layer can go back to holding exactly `num_tokens` tokens."""
        drop = self.num_tokens - num_tokens
        return 0 <= drop <= self.num_tokens and all(layer_can_trim(x, drop) for x in self.layers)

    def trim_to(self, num_tokens: int) -> int:
        """Keeps the first `num_tokens` tokens and drops the rest, in every layer or none.

        Returns:
            The number of tokens dropped.

        Raises:
            ValueError: num_tokens is negative or more than are held.
            NotSupportedError: some layer cannot go back that far (recurrent state, or a
                sliding window that no longer holds what position `num_tokens` needs).
        """
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(
                f"cannot trim to {num_tokens} tokens; the cache holds {self.num_tokens}"
            )
        drop = self.num_tokens - num_tokens
        if not self.can_trim_to(num_tokens):
            kinds = sorted({type(x).__name__ for x in self.layers if not layer_can_trim(x, drop)})
            raise NotSupportedError(
                f"cannot go back from {self.num_tokens} to {num_tokens} tokens: layers of type "
                f"{', '.join(kinds)} cannot trim that far; free() the cache and prefill again"
            )
        if drop:
            for layer in self.layers:
                layer.trim(drop)
            self._settle()
            del self._tokens[num_tokens:]
            self._forget_after(num_tokens)
        return drop

    def _forget_after(self, num_tokens: int) -> None:
        """Drops what described tokens past `num_tokens`, now gone: checkpoints, disk
        snapshots, and the shift's mark once only the tokens it kept exact are left."""
        drop_checkpoints_after(num_tokens, self._checkpoints, self._disk_snapshots)
        if self.shifted and num_tokens <= self._exact_tokens:
            self._exact_tokens = None

    @property
    def needs_checkpoints(self) -> bool:
        """True when some layer cannot go back by trimming (recurrent or sliding window)."""
        return any(not always_trimmable(layer) for layer in leaves(self.layers))

    def checkpoint(self) -> None:
        """Snapshots, at the current length, the layers that cannot trim back, so a later
        request can return here (`rewind_to`). Keeps the earliest and the newest, at most
        `MAX_CHECKPOINTS`; their bytes are in `footprint()`."""
        if not self.needs_checkpoints or self.num_tokens in self._checkpoints:
            return
        at = self._disk_snapshots.get(self.num_tokens)  # shared, not copied again
        add_checkpoint(self._checkpoints, self.num_tokens, at or snapshot_layers(self.layers))

    def snapshot_for_disk(self) -> None:
        """`checkpoint()` for the disk tier's blocks, apart from the checkpoints and their limit
        until its writer takes them (`take_disk_snapshots`), counted in `footprint()`; lazy,
        evaluated with the layers (`arrays()`), so no prefill lane or decode step waits."""
        if self.needs_checkpoints and self.num_tokens not in self._disk_snapshots:
            at = self._checkpoints.get(self.num_tokens)
            snapshot = at or snapshot_layers(self.layers, evaluate=False)
            self._disk_snapshots[self.num_tokens] = snapshot

    def take_disk_snapshots(self) -> dict[int, list[Any]]:  # by length; forgotten here
        taken, self._disk_snapshots = self._disk_snapshots, {}
        return taken

    @property
    def disk_snapshots(self) -> dict[int, list[Any]]:  # by length, not yet taken (a copy)
        return dict(self._disk_snapshots)

    @property
    def checkpoints(self) -> dict[int, list[Any]]:
        """Checkpoints by length in tokens: per layer a snapshot, or None for layers that trim
        back instead. Read-only: snapshots are never changed in place, so they may be shared."""
        return dict(self._checkpoints)

    def adopt(
        self,
        layers: list[Any],
        tokens: list[int],
        checkpoints: dict[int, list[Any]],
        disk: dict[int, list[Any]] | None = None,
        exact_tokens: int | None = None,
    ):
        """Replaces everything held with `layers` holding `tokens` (a loaded or copied state),
        with `checkpoints` and the disk tier's snapshots `disk` (by length, as they are taken).
        `exact_tokens`: a loaded state's shift mark (`exact_tokens`, saved with it); None
        keeps this cache's own (a batch's rows come back here grown from what they held).

        Raises:
            ValueError: a layer's offset is not len(tokens), or a checkpoint lies past it.
        """
        written = [x for x in leaves(layers) if hasattr(x, "offset") and not is_unwritten(x)]
        offsets = {layer.offset for layer in written}
        if offsets - {len(tokens)} or any(n > len(tokens) for n in checkpoints):
            raise ValueError(
                f"layers at offsets {sorted(offsets)} with checkpoints at {sorted(checkpoints)} "
                f"do not hold {len(tokens)} tokens"
            )
        self.layers = layers
        self.gate = None
        self._pending.clear()
        self._num_pending = 0
        self._tokens = list(tokens)
        self._checkpoints = dict(checkpoints)
        self._disk_snapshots = dict(disk or {})
        if exact_tokens is not None:
            self._exact_tokens = exact_tokens
        if self.shifted and len(tokens) <= self._exact_tokens:  # rows grown back, or free()
            self._exact_tokens = None

    def nearest_restorable(self, num_tokens: int) -> int:
        """The largest length <= num_tokens it can go back to, trimming or from a checkpoint
        (0: starting over)."""
        if self.can_trim_to(num_tokens):
            return num_tokens
        return max((n for n in self._checkpoints if n <= num_tokens), default=0)

    def rewind_to(self, num_tokens: int, *, shrink: bool = False) -> int:
        """Goes back to `num_tokens` by trimming, or by restoring the checkpoint taken there
        (to 0 by starting over when the layers cannot trim); with `shrink`, then gives back
        the buffer slots a large trim leaves (`shrink()`).

        Returns:
            The number of tokens dropped.

        Raises:
            NotSupportedError: neither is possible (see `nearest_restorable`).
        """
        dropped = self._rewind(num_tokens)
        if shrink and dropped:
            self.shrink()
        return dropped

    def _rewind(self, num_tokens: int) -> int:
        if num_tokens == 0 and not self.can_trim_to(0):  # starting over is always possible
            dropped = self.num_tokens
            self.free()
            return dropped
        if self.can_trim_to(num_tokens) or num_tokens not in self._checkpoints:
            return self.trim_to(num_tokens)
        dropped = self.num_tokens - num_tokens
        snapshot = self._checkpoints[num_tokens]
        for i, saved in enumerate(snapshot):
            if saved is None:
                self.layers[i].trim(self.layers[i].offset - num_tokens)
            else:
                self.layers[i] = copy_layer(saved)  # the checkpoint stays reusable
        self._settle()
        del self._tokens[num_tokens:]
        self._forget_after(num_tokens)
        return dropped

    def can_shift(self, rotations: Sequence[Rotation | None] | None) -> bool:
        """True when `shift` can run: every layer a float KVCache with a rotation."""
        if rotations is None or len(rotations) != len(self.layers):
            return False
        return all(
            type(layer) is KVCache and rotate is not None
            for layer, rotate in zip(self.layers, rotations, strict=True)
        )

    def shift(self, keep: int, drop: int, rotations: Sequence[Rotation | None]) -> None:
        """Drops tokens [keep, keep + drop) from every layer and the token list, moving later
        tokens back `drop` positions (their keys re-rotated by `rotations[i]` per layer).

        Raises:
            NotSupportedError: some layer cannot shift (`can_shift` is False).
            ValueError: the span is not inside the held tokens.
        """
        if not self.can_shift(rotations):
            raise NotSupportedError(
                "this cache cannot shift: it needs float KVCache layers and a known RoPE per "
                "layer; free() it and prefill the kept tokens instead"
            )
        self.pass_gate()
        if keep < 0 or drop < 0 or keep + drop > self.num_tokens:
            raise ValueError(
                f"cannot drop tokens {keep}..{keep + drop - 1}; the cache holds {self.num_tokens}"
            )
        self._settle()
        for layer, rotate in zip(self.layers, rotations, strict=True):
            layer.shift(keep, drop, rotate)
        del self._tokens[keep : keep + drop]
        self._checkpoints.clear()  # positions moved
        self._disk_snapshots.clear()
        self._exact_tokens = min(keep, self._exact_tokens if self.shifted else keep)

    def copy(self) -> ModelCache:  # an independent cache of the same tokens (K/V, not slack)
        return self.copy_prefix(self.num_tokens)

    def copy_prefix(self, num_tokens: int) -> ModelCache:
        """An independent cache holding the first `num_tokens` tokens, for a request that
        shares only that prefix: K/V copied up to there (not the rest, not the slack), layers
        that cannot trim taken from the checkpoint there. Checkpoints (and disk snapshots) at
        or before it are shared, not copied (never changed in place). This cache is unchanged.

        Raises:
            NotSupportedError: neither trimming nor a checkpoint reaches `num_tokens`
                (`nearest_restorable(num_tokens) != num_tokens`).
        """
        self.pass_gate()
        if self.nearest_restorable(num_tokens) != num_tokens:
            raise NotSupportedError(
                f"cannot copy the first {num_tokens} of {self.num_tokens} tokens: some layers "
                "cannot go back there and no checkpoint was taken there"
            )
        if num_tokens == 0:  # starting over (layers that cannot trim have no checkpoint at 0)
            return ModelCache(self._make_layers(), self._make_layers, self.capacity_tokens)
        self._settle()
        drop = self.num_tokens - num_tokens
        snapshot = None if self.can_trim_to(num_tokens) else self._checkpoints[num_tokens]
        saved = snapshot or [None] * len(self.layers)
        layers = [
            copy_layer(layer, drop) if at is None else copy_layer(at)
            for layer, at in zip(self.layers, saved, strict=True)
        ]
        kept = {n: snap for n, snap in self._checkpoints.items() if n <= num_tokens}
        clone = ModelCache([], self._make_layers, self.capacity_tokens)
        # the copy may write the blocks its disk snapshots fall in before this cache does
        disk = {n: s for n, s in self._disk_snapshots.items() if n <= num_tokens}
        clone.adopt(layers, self._tokens[:num_tokens], kept, disk)
        clone.snapshot_every_tokens = self.snapshot_every_tokens
        if self.shifted and num_tokens > self._exact_tokens:
            clone._exact_tokens = self._exact_tokens
        return clone

    def pass_gate(self) -> None:
        """Waits until every layer of a restore still being checked passed (`gate`); one that
        fails leaves the cache empty (nothing of the restore is kept)."""
        if self.gate is None:
            return
        try:
            self.gate.wait_all()
        except RestoreBroken:
            self.free()
        self.gate = None

    def free(self) -> None:  # drops every token and the memory that held them
        self.adopt(self._make_layers(), [], {})

    def shrink(self, exact: bool = False) -> int:
        """Frees slots past the next growth step above the tokens (`exact`: all past them)."""
        return sum(layer.shrink(exact) for layer in leaves(self.layers) if hasattr(layer, "shrink"))

    def arrays(self) -> list[mx.array]:
        """Every array the layers and disk snapshots hold (`mx.eval` of it leaves none lazy)."""
        self.pass_gate()
        snapshots = [s for snap in self._disk_snapshots.values() for s in snap if s]
        return [a for layer in [*self.layers, *snapshots] for a in arrays_of(layer)]

    def footprint(self) -> Footprint:
        """Tokens held and their bytes, checkpoints included, read in one walk."""
        snapshots = [*self._checkpoints.values(), *self._disk_snapshots.values()]
        return measure(self.layers, snapshots, self.num_tokens)

    @property
    def nbytes(self) -> int:  # bytes allocated by all layers (including unused slots)
        return self.footprint().allocated_bytes

    @property
    def used_bytes(self) -> int:  # bytes holding the tokens' K/V and recurrent state
        return self.footprint().used_bytes
