"""Checking a GGUF file's header and tensor table before MLX reads it.

Owns: `check_gguf(path)`, a bounds-checked read of everything before the tensor data: the
magic, version, counts, every metadata key and value, and every tensor's name, shape, type and
offset. MLX's own reader trusts these numbers (a string length of 2**62 crashed the process
inside `mx.load`), so each one is checked against the bytes that are really in the file.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

from mlxkv.errors import UnsupportedFormatError

# Value types: id -> struct format of a scalar (8: string, 9: array are read separately).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Tensor types MLX reads: id -> (name, elements per block, bytes per block).
TENSOR_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
                8: ("Q8_0", 32, 34)}  # fmt: skip
_MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32


class _Reader:
    """Reads little-endian values, refusing any read past the end of the file."""

    def __init__(self, f: BinaryIO, size: int, name: str):
        self.f, self.size, self.name = f, size, name

    def fail(self, what: str) -> UnsupportedFormatError:
        return UnsupportedFormatError(f"{self.name} is not a valid GGUF file: {what}")

    def take(self, num_bytes: int, what: str) -> bytes:
        if num_bytes > self.size - self.f.tell():
            raise self.fail(f"{what} needs {num_bytes} bytes, past the end of the file")
        return self.f.read(num_bytes)

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.scalar("<Q", f"{what} length")
        return self.take(length, what).decode("utf-8", errors="replace")

    def value(self, kind: int, what: str) -> object:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            item_kind = self.scalar("<I", f"{what} element type")
            count = self.scalar("<Q", f"{what} length")
            smallest = 8 if item_kind == _STRING else struct.calcsize(_SCALARS.get(item_kind, "B"))
            if item_kind == _ARRAY or (item_kind not in _SCALARS and item_kind != _STRING):
                raise self.fail(f"{what} has elements of unknown type {item_kind}")
            if count * smallest > self.size - self.f.tell():
                raise self.fail(f"{what} claims {count} elements, more than the file holds")
            if item_kind == _STRING:
                return [self.string(what) for _ in range(count)]
            fmt = _SCALARS[item_kind]
            data = self.take(count * struct.calcsize(fmt), what)
            return list(struct.unpack(f"<{count}{fmt[1]}", data))
        raise self.fail(f"{what} has unknown value type {kind}")


def check_gguf(path: Path) -> dict[str, object]:
    """Checks the header and tensor table of a GGUF file against its size.

    Returns:
        The metadata (key -> value; arrays as lists).

    Raises:
        UnsupportedFormatError: not a GGUF file, a truncated or inconsistent one (the message
            names the file and what is wrong), or tensors of a type MLX cannot read.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        r = _Reader(f, size, path.name)
        if size == 0:
            raise r.fail("the file is empty")
        magic = r.take(4, "the magic number") if size >= 4 else b""
        if magic != b"GGUF":
            raise r.fail(f"it starts with {magic!r}, not b'GGUF'")
        version = r.scalar("<I", "the version")
        if version not in (2, 3):
            raise r.fail(f"version {version} is not 2 or 3")
        num_tensors = r.scalar("<Q", "the tensor count")
        num_keys = r.scalar("<Q", "the metadata count")
        if num_tensors > size or num_keys > size:  # every entry takes at least a byte
            raise r.fail(f"it claims {num_tensors} tensors and {num_keys} metadata entries")
        metadata = {}
        for i in range(num_keys):
            key = r.string(f"metadata key {i}")
            metadata[key] = r.value(r.scalar("<I", f"the type of {key!r}"), repr(key))
        tensors = [_tensor_info(r, i) for i in range(num_tensors)]
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise r.fail(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-f.tell() // alignment) * alignment
    for name, offset, nbytes in tensors:
        if offset % alignment:
            raise r.fail(f"tensor {name!r} starts at {offset}, not a multiple of {alignment}")
        if data_start + offset + nbytes > size:
            raise r.fail(f"tensor {name!r} ends past the end of the file (truncated?)")
    return metadata


def _tensor_info(r: _Reader, index: int) -> tuple[str, int, int]:
    """(name, offset in the data section, bytes) of one tensor table entry."""
    name = r.string(f"tensor {index} name")
    num_dims = r.scalar("<I", f"tensor {name!r} dimension count")
    if not 1 <= num_dims <= _MAX_DIMS:
        raise r.fail(f"tensor {name!r} has {num_dims} dimensions")
    dims = [r.scalar("<Q", f"tensor {name!r} shape") for _ in range(num_dims)]
    kind = r.scalar("<I", f"tensor {name!r} type")
    offset = r.scalar("<Q", f"tensor {name!r} offset")
    if kind not in TENSOR_TYPES:
        supported = ", ".join(t[0] for t in TENSOR_TYPES.values())
        raise UnsupportedFormatError(
            f"{r.name}: tensor {name!r} has GGUF type {kind}; supported: {supported}. "
            "Use a Q8_0, Q4_0, Q4_1 or F16 file"
        )
    type_name, block, block_bytes = TENSOR_TYPES[kind]
    elements = 1
    for d in dims:
        elements *= d
    if dims[0] % block or elements == 0:
        raise r.fail(f"tensor {name!r} of type {type_name} has shape {dims}")
    return name, offset, elements // block * block_bytes
