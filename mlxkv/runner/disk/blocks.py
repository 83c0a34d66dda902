"""A cache entry's arrays cut into blocks of tokens, and a chain's blocks put back together, for
every layer kind the cache holds.

Owns `cut_block` (one block's arrays and layout, its K/V quantized with `kv_bits`),
`join_blocks` (the arrays and layout that rebuild a chain's first `num_tokens` tokens, its
K/V dequantized) and which layers are cut by token. Does not own
files or chains (`files`, `chains`), nor turning arrays into caches (`mlxkv.cache.serialize`).

Terms:
  sliced layer  a layer whose state is the K/V of every token it holds, along the token axis
                (`KVCache`, `QuantizedKVCache`, a `CacheList` of them): a block holds its
                tokens' slice;
  state layer   any other (recurrent `ArraysCache`, sliding window, chunked attention): its
                state at one length cannot be cut, so a block holds its snapshots at the
                cache's checkpoints that fall in the block, and its state at the block's end
                when the entry ends there (`end_state`).
  stop          a length a chain can be restored to: any for a model of sliced layers only;
                else a checkpoint or an entry's end held in its blocks (the rules a cache in
                memory follows: `ModelCache.nearest_restorable`).

Invariant: a block's layout names every layer as the whole entry's does; its arrays hold the
sliced layers' tokens `start`..`end`, the snapshots of its `checkpoints` and, with `end_state`,
the state layers' arrays at `end`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxkv.cache.checkpoints import MAX_CHECKPOINTS
from mlxkv.errors import CacheStateError

SLICED_KINDS = frozenset({"KVCache", "QuantizedKVCache"})
_TOKEN_AXIS = 2  # K/V arrays (and quantized K/V's parts) are (B, H, L, D)
# Head-dimension elements sharing one scale and bias in K/V quantized on disk: mx.quantize's
# default, else the largest it accepts that divides the head dimension (none: not quantized).
DISK_GROUP_SIZES = (64, 32)
_PARTS = (".q", ".scales", ".biases")  # a quantized array's names: its name + each
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32"})  # safetensors' names
_PACKED_DTYPE = "U32"  # quantized K/V's values (mx.quantize's), in memory or on disk


def is_sliced(entry: dict[str, Any]) -> bool:
    """True for a layer (a layout entry) whose arrays are cut by token."""
    if entry["kind"] == "CacheList":
        return all(is_sliced(child) for child in entry["children"])
    return entry["kind"] in SLICED_KINDS


def array_names(entry: dict[str, Any] | None) -> list[str]:
    """The names of the arrays a layer's layout entry (a layer or a snapshot) refers to."""
    if entry is None:
        return []
    if entry["kind"] == "CacheList":
        return [name for child in entry["children"] for name in array_names(child)]
    if "arrays" in entry:  # an ArraysCache
        return list(entry["arrays"])
    return [f"{entry['prefix']}/{path}" for path in entry["paths"]]


def stops(layout: dict[str, Any], end: int) -> tuple[int, ...]:
    """The lengths, in tokens from the chain's start, a block (its layout, ending at `end`)
    holds every state layer at."""
    points = tuple(int(point["at"]) for point in layout["checkpoints"])
    return points + ((end,) if layout.get("end_state") else ())


def check_block(
    layout: dict[str, Any], arrays: dict[str, tuple[tuple[int, ...], str]], num_tokens: int
) -> None:
    """Raises ValueError unless a block's arrays (name -> shape and safetensors dtype, from
    its header) are the ones its layout names, no more and no fewer, and each sliced layer's
    holds the block's `num_tokens` tokens: (1, heads, num_tokens, dim), a `KVCache`'s of a
    float dtype, a quantized one's packed uint32 values and float scales and biases. The CRC
    says only that a file is as it was written: a block whose K/V held more or fewer tokens
    than its token ids, or integers (joined to its neighbours' as float, unseen after), would
    answer wrongly, and a loop over arrays no layer reads would cost every load."""
    quantized = layout.get("quantized", {})
    expected: set[str] = set()
    for entry in layout["layers"]:
        if is_sliced(entry):
            for name, kind in _sliced_arrays(entry):
                for part in _PARTS if name in quantized else ("",):
                    held = arrays.get(name + part, ((), ""))
                    _check_slice(name + part, held, num_tokens, _kv_dtypes(kind, name, part))
                    expected.add(name + part)
        elif layout.get("end_state"):
            expected.update(array_names(entry))
    for point in layout["checkpoints"]:
        expected.update(name for entry in point["layers"] for name in array_names(entry))
    if set(arrays) != expected:
        odd = sorted(set(arrays) ^ expected)
        raise ValueError(f"{len(odd)} arrays held or named alone, as {odd[0]}")


def _sliced_arrays(entry: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, the class of the layer holding it) of a sliced layer's arrays."""
    if entry["kind"] == "CacheList":
        return [found for child in entry["children"] for found in _sliced_arrays(child)]
    return [(name, entry["kind"]) for name in array_names(entry)]


def _kv_dtypes(kind: str, name: str, part: str) -> frozenset[str]:
    """The dtypes a sliced array (`part`: one of `_PARTS` where it is quantized on disk) may
    have: a quantized layer's state is (values, scales, biases) for keys then values, as
    tree paths `<0|1>.<0|1|2>`; its values packed, as the disk's `.q`."""
    packed = part == _PARTS[0] or (not part and kind == "QuantizedKVCache" and name[-2:] == ".0")
    return frozenset({_PACKED_DTYPE}) if packed else _FLOAT_DTYPES


def _check_slice(
    name: str, held: tuple[tuple[int, ...], str], num_tokens: int, dtypes: frozenset[str]
) -> None:
    shape, dtype = held
    if len(shape) != 4 or shape[0] != 1 or shape[_TOKEN_AXIS] != num_tokens:
        raise ValueError(f"{name} is {shape}; a block of {num_tokens} tokens holds (1, H, L, D)")
    if dtype not in dtypes:
        raise ValueError(f"{name} is {dtype}, not K/V")


def cut_block(
    arrays: dict[str, mx.array],
    layout: dict[str, Any],
    start: int,
    end: int,
    num_tokens: int,
    kv_bits: int | None = None,
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """The arrays and layout of the block of tokens `start`..`end` of an entry holding
    `num_tokens` (`cache_to_arrays`'s `arrays` and `layout`). The sliced layers' K/V are
    copied (a write in flight then holds no view of buffers the next request updates in
    place); snapshots are never changed in place, so they are shared. `kv_bits`: float K/V
    layers' arrays are stored quantized to that many bits (`DISK_GROUP_SIZES`); the layout's
    "quantized" names them, with what `_dequantized` needs."""
    block: dict[str, mx.array] = {}
    quantized: dict[str, list] = {}
    for entry in layout["layers"]:
        if is_sliced(entry):
            for name in array_names(entry):
                block[name] = mx.contiguous(arrays[name][:, :, start:end, :])
            for name in _float_kv_names(entry) if kv_bits else ():
                group = next((g for g in DISK_GROUP_SIZES if block[name].shape[-1] % g == 0), 0)
                if group:
                    dtype = str(block[name].dtype).removeprefix("mlx.core.")
                    parts = mx.quantize(block.pop(name), group_size=group, bits=kv_bits)
                    block.update({name + part: a for part, a in zip(_PARTS, parts, strict=True)})
                    quantized[name] = [kv_bits, group, dtype]
        elif end == num_tokens:
            block.update({name: arrays[name] for name in array_names(entry)})
    points = [point for point in layout["checkpoints"] if start < int(point["at"]) <= end]
    for point in points:
        block.update({n: arrays[n] for entry in point["layers"] for n in array_names(entry)})
    block_layout = {**layout, "checkpoints": points, "end_state": end == num_tokens}
    if layout.get("exact_tokens", end) >= end:  # a shift left all its tokens exact
        block_layout.pop("exact_tokens", None)
    return block, {**block_layout, "quantized": quantized} if quantized else block_layout


def _dequantized(arrays: dict[str, mx.array], layout: dict[str, Any]) -> dict[str, mx.array]:
    """A block's arrays (as `cut_block` made them) with those stored quantized dequantized
    to their dtype. Changes `arrays` in place, and returns it."""
    for name, (bits, group, dtype) in layout.get("quantized", {}).items():
        q, scales, biases = (arrays.pop(name + part) for part in _PARTS)
        arrays[name] = mx.dequantize(
            q, scales, biases, group_size=int(group), bits=int(bits), dtype=getattr(mx, dtype)
        )
    return arrays


def _float_kv_names(entry: dict[str, Any]) -> list[str]:
    """The arrays of a sliced layer's `KVCache` parts (not already quantized)."""
    if entry["kind"] == "CacheList":
        return [name for child in entry["children"] for name in _float_kv_names(child)]
    return array_names(entry) if entry["kind"] == "KVCache" else []


class BadBlock(ValueError):
    """A block of a join whose arrays `check` refused: `index` in the blocks given."""

    def __init__(self, index: int, why: Exception):
        super().__init__(f"block {index} of the chain: {why}")
        self.index = index


def join_blocks(
    blocks: list[tuple[dict[str, mx.array], dict[str, Any]]],
    num_tokens: int,
    check: Callable[[dict[str, mx.array]], None] | None = None,
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """The arrays and layout (`arrays_to_cache`'s) of the first `num_tokens` tokens of a
    chain's consecutive `blocks` ((arrays, layout), first to last), `num_tokens` one of the
    last block's `stops` unless every layer is sliced; each block's arrays (dequantized)
    passed to `check` first, so a refusal names its block.

    Raises:
        KeyError: no block holds the state layers at `num_tokens`.
        BadBlock: `check` raised for a block.
    """
    blocks = [(_dequantized(arrays, layout), layout) for arrays, layout in blocks]
    for index, (arrays, _) in enumerate(blocks):
        try:
            if check is not None:
                check(arrays)
        except (ValueError, CacheStateError) as why:
            raise BadBlock(index, why) from why
    last_arrays, last_layout = blocks[-1]
    points = [(arrays, point) for arrays, layout in blocks for point in layout["checkpoints"]]
    points = _kept([(a, p) for a, p in points if int(p["at"]) <= num_tokens])
    at_stop = {int(point["at"]): point for _, point in points}.get(num_tokens)
    joined: dict[str, mx.array] = {}
    layers = []
    for i, entry in enumerate(last_layout["layers"]):
        if is_sliced(entry):
            for name in array_names(entry):
                parts = [arrays[name] for arrays, _ in blocks]
                whole = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=_TOKEN_AXIS)
                joined[name] = whole[:, :, :num_tokens, :]
            layers.append(entry)
        elif at_stop is not None:
            layers.append(at_stop["layers"][i])
        elif last_layout.get("end_state"):
            joined.update({name: last_arrays[name] for name in array_names(entry)})
            layers.append(entry)
        else:
            raise KeyError(f"no state of layer {i} at {num_tokens} tokens")
    for arrays, point in points:
        joined.update({n: arrays[n] for entry in point["layers"] for n in array_names(entry)})
    checkpoints = [point for _, point in points]
    joined_layout = {
        key: value for key, value in last_layout.items() if key not in ("quantized", "exact_tokens")
    }
    # a block a shift approximated marks every token after its exact ones (blocks are shared)
    exact = [int(layout["exact_tokens"]) for _, layout in blocks if "exact_tokens" in layout]
    if exact:
        joined_layout["exact_tokens"] = min(exact)
    return joined, {**joined_layout, "layers": layers, "checkpoints": checkpoints}


def _kept(points: list[tuple[Any, dict[str, Any]]]) -> list[tuple[Any, dict[str, Any]]]:
    """The checkpoints a cache in memory would keep of these: the earliest and the newest, at
    most `MAX_CHECKPOINTS` (`add_checkpoint`)."""
    points = sorted(points, key=lambda item: int(item[1]["at"]))
    return points[:1] + points[1:][-(MAX_CHECKPOINTS - 1) :]
