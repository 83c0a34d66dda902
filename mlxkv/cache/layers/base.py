"""The per-layer cache protocol, and the helpers every cache class shares.

Owns: `LayerCache`, the contract between a model layer and its cache, written to match what
`mlx_lm.models` calls; `round_up`; the causal mask helper. Does not own: any concrete storage.

Terms:
  offset    the number of tokens a layer has seen, i.e. the RoPE position of the next token.
  held      tokens whose K/V the layer still stores (a sliding window holds fewer than offset).
  capacity  token slots allocated; `nbytes` counts them, `used_bytes` counts only the held ones.

Invariants every implementation keeps:
  - `trim(n)` never leaves history that is wrong for the new offset: a cache that cannot go back
    n tokens raises `NotSupportedError` instead (ask `can_trim(n)` first);
  - `state` holds only the used part, in time order, so it round-trips through `from_state`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxkv.errors import CacheStateError

DEFAULT_STEP_TOKENS = 256


def round_up(n: int, step: int) -> int:
    """Smallest multiple of `step` that is >= n."""
    return -(-n // step) * step


def check_trim_count(n: int) -> None:
    """Rejects a negative trim, which would silently grow the offset."""
    if n < 0:
        raise ValueError(f"cannot trim {n} tokens; the count must be >= 0")


def causal_mask(
    num_queries: int, offset: int, window_size: int | None, return_array: bool
) -> mx.array | str | None:
    """Mask for `num_queries` new tokens after `offset` held tokens, all held in time order.

    Returns what mlx-lm's attention accepts: None (attend to everything, one query), the string
    "causal" (MLX builds the mask), or a boolean array (L, offset + L) where True means attend.
    """
    if window_size is not None and offset + num_queries > window_size:
        return _window_mask(num_queries, offset, window_size)
    if num_queries == 1:
        return None
    if return_array:
        return _window_mask(num_queries, offset, None)
    return "causal"


def _window_mask(num_queries: int, offset: int, window_size: int | None) -> mx.array:
    query_pos = mx.arange(offset, offset + num_queries)[:, None]
    key_pos = mx.arange(offset + num_queries)[None]
    mask = query_pos >= key_pos
    if window_size is not None:
        mask = mask & (query_pos < key_pos + window_size)
    return mask


@runtime_checkable
class LayerCache(Protocol):
    """What a model layer and the cache manager need from one layer's cache.

    Shapes: keys and values are (B, H, L, D): batch, KV heads, tokens, head dimension.
    """

    offset: int

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Appends L new tokens' K/V and returns the K/V the new queries attend to.

        The returned arrays are owned by the cache and valid until its next update; the order of
        tokens in them matches the mask from the `make_mask` call made just before.
        """
        ...

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """The attention mask for the next update of N tokens (called before it)."""
        ...

    def is_trimmable(self) -> bool:
        """True when `trim(1)` would succeed."""
        ...

    def can_trim(self, n: int) -> bool:
        """True when the cache can go back n tokens with exact history."""
        ...

    def trim(self, n: int) -> int:
        """Drops the newest n tokens (fewer if fewer are held); returns how many it dropped.

        Raises:
            NotSupportedError: when tokens that the new position needs are no longer held.
        """
        ...

    @property
    def state(self) -> Any:
        """Arrays holding the used part, in time order."""
        ...

    @property
    def meta_state(self) -> tuple[str, ...]:
        """Scalars needed with `state` to rebuild the cache, as strings."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes allocated, including slots not yet used."""
        ...

    @property
    def used_bytes(self) -> int:
        """Bytes of the held tokens only."""
        ...

    def empty(self) -> bool:
        """True before the first update."""
        ...


class BufferedCache:
    """Byte accounting shared by caches that keep K/V in `keys` / `values` buffers (arrays, or
    tuples of arrays when quantized) with `capacity_tokens` slots, `_used_slots()` of them held."""

    keys: Any
    values: Any

    def _used_slots(self) -> int:
        raise NotImplementedError

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for _, a in tree_flatten([self.keys, self.values]))

    @property
    def used_bytes(self) -> int:
        if self.keys is None:
            return 0
        return self.nbytes * self._used_slots() // self.capacity_tokens


class ContiguousCache(BufferedCache):
    """Offset bookkeeping shared by caches that hold positions 0..offset-1 in slots 0..offset-1.

    Subclasses provide `capacity_tokens`, `nbytes`, `state` and `meta_state`. Trim is O(1): it
    only moves the offset, and the next update overwrites the slots past it.
    """

    offset: int
    step: int
    keys: Any
    values: Any

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        return causal_mask(N, self.offset, window_size, return_array)

    def is_trimmable(self) -> bool:
        return True

    def can_trim(self, n: int) -> bool:
        return 0 <= n <= self.offset

    def trim(self, n: int) -> int:
        check_trim_count(n)
        n = min(n, self.offset)
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def _used_slots(self) -> int:
        return self.offset

    def shrink(self, exact: bool = False) -> int:
        """Frees the slots beyond the next step boundary above the offset, or with `exact`
        every slot past it (an entry kept within a byte budget smaller than one growth step;
        the next update grows it a step again).

        Returns:
            The bytes given back (0 when there was nothing to free).
        """
        target = self.offset if exact else round_up(self.offset, self.step)
        if self.keys is None or target >= self.capacity_tokens:
            return 0
        before = self.nbytes
        if target == 0:
            self.keys = self.values = None
        else:
            self._reallocate(self.keys, self.values, target)
        return before - self.nbytes

    @classmethod
    def from_state(cls, state: Any, meta_state: tuple[str, ...] = ()):
        """Rebuilds a cache from `state` and `meta_state` (as saved by a cache of this class).

        Raises:
            CacheStateError: they are not what a cache of this class saves.
        """
        cache = cls()
        with state_errors(cls.__name__):
            if meta_state:
                cache.meta_state = meta_state
            cache.state = state
        return cache


@contextmanager
def state_errors(class_name: str) -> Iterator[None]:
    """Turns the errors of unpacking a malformed saved state into a CacheStateError."""
    try:
        yield
    except (ValueError, TypeError, AttributeError, IndexError) as error:
        raise CacheStateError(
            f"this state and meta_state were not saved by a {class_name}: {error}. "
            "Rebuild the cache with the class that saved it"
        ) from error


def resized_buffer(old: mx.array | None, like: mx.array, num_used: int, capacity: int) -> mx.array:
    """A new (B, H, capacity, D) array starting with old's first `num_used` token slots.

    Always a fresh allocation (never a view), so the old buffer can be freed.
    `like` gives B, H, D and the dtype.
    """
    B, H, _, D = like.shape
    pad = mx.zeros((B, H, capacity - num_used, D), dtype=like.dtype)
    if old is None or num_used == 0:
        return pad
    used = old[..., :num_used, :]
    return mx.concatenate([used, pad], axis=2) if capacity > num_used else mx.contiguous(used)
