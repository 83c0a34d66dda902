"""Reading a GGUF file's metadata and tensor table, checked against the bytes in the file.

Owns: `read_metadata(path)`, which parses the file with llama.cpp's `gguf` package
(`gguf.GGUFReader`) and refuses, with one `UnsupportedFormatError` naming the file, anything
MLX cannot safely read: a wrong magic or version, counts, lengths or offsets past the end of the
file, and tensors of a type or shape MLX does not load. MLX's own reader trusts these numbers
(a string length of 2**62 crashed the process inside `mx.load`), so this runs first. Does not
own the tensor data (`mx.load` reads it) or what the metadata means (`hf_config`, `tokenizer`).

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3).
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField

from mlxkv.errors import UnsupportedFormatError

# Tensor types `mx.load` reads (every other type is refused by name).
SUPPORTED_TENSOR_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q8_0,
)
_VALUE_TYPES = frozenset(int(t) for t in GGUFValueType)
_MAX_DIMS = 4
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count


def read_metadata(path: Path) -> dict[str, Any]:
    """Reads and checks the header, metadata and tensor table of a GGUF file.

    Returns:
        The metadata, key -> value (numbers and strings as Python values, arrays as lists).

    Raises:
        UnsupportedFormatError: not a GGUF file, a truncated or inconsistent one (the message
            names the file and what is wrong), or tensors of a type MLX cannot read.
    """
    _check_header(path)
    try:
        reader = _BoundedReader(path)
        return {
            key: field.contents()
            for key, field in reader.fields.items()
            if not key.startswith("GGUF.")  # the reader's own header fields
        }
    except (ValueError, KeyError, IndexError, OverflowError) as error:
        # gguf's own refusals: an unknown value type, a duplicate key, a string not UTF-8
        detail = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise _invalid(path, str(detail)) from error


def _invalid(path: Path, what: str) -> UnsupportedFormatError:
    return UnsupportedFormatError(f"{path.name} is not a valid GGUF file: {what}")


def _check_header(path: Path) -> None:
    """The fixed-size header, checked before `GGUFReader` sees the file: it cannot map an
    empty file, accepts a byte-swapped (big-endian) file MLX cannot read, and walks counts of
    up to 2**64 entries; each of those gets its own message here."""
    size = path.stat().st_size
    if size == 0:
        raise _invalid(path, "the file is empty")
    with path.open("rb") as f:
        head = f.read(_HEADER.size)
    if head[:4] != b"GGUF":
        raise _invalid(path, f"it starts with {head[:4]!r}, not b'GGUF'")
    if len(head) < _HEADER.size:
        raise _invalid(path, f"the header needs {_HEADER.size} bytes, past the end of the file")
    _, version, num_tensors, num_keys = _HEADER.unpack(head)
    if version not in (2, 3):
        raise _invalid(path, f"version {version} is not 2 or 3")
    if num_tensors > size or num_keys > size:  # every entry takes at least a byte
        raise _invalid(path, f"it claims {num_tensors} tensors and {num_keys} metadata entries")


class _BoundedReader(GGUFReader):
    """`GGUFReader` with every read kept inside the file.

    Why the overrides: `GGUFReader` reads through a numpy memmap, where a read past the end of
    the file quietly returns fewer bytes. A hostile string length then yields a cut string and
    the parse goes on at a wrong offset, and an array whose count passes the end loops that many
    times (up to 2**64), appending an empty read each time. So `_get` refuses any read past the
    end, `_get_field_parts` checks an array's count against the bytes left before the reader
    loops over it, and `_build_tensors` checks the tensor table (type, shape, offset, size)
    before the reader maps the tensors. These are private methods of `gguf`: pyproject pins
    its version range, and tests/models/test_gguf_reader.py fails if their signatures change.
    """

    def __init__(self, path: Path):
        self._path = path
        super().__init__(path, mode="r")

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None):
        num_bytes = int(count) * np.dtype(dtype).itemsize
        if offset + num_bytes > len(self.data):
            raise _invalid(
                self._path,
                f"{num_bytes} bytes at byte {offset} lie past the end of the file "
                f"({len(self.data)} bytes)",
            )
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if int(raw_type) not in _VALUE_TYPES:
            raise _invalid(self._path, f"the value at byte {orig_offs} has unknown type {raw_type}")
        if raw_type == GGUFValueType.ARRAY:
            item_type = int(self._get(orig_offs, np.uint32)[0])
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            if item_type == GGUFValueType.STRING:
                smallest = 8  # the length of an empty string
            elif item_type in self.gguf_scalar_to_np:
                smallest = np.dtype(self.gguf_scalar_to_np[GGUFValueType(item_type)]).itemsize
            else:
                raise _invalid(
                    self._path, f"the array at byte {orig_offs} has elements of type {item_type}"
                )
            if count * smallest > len(self.data) - orig_offs - 12:
                raise _invalid(
                    self._path,
                    f"the array at byte {orig_offs} claims {count} elements, more than the "
                    "file holds",
                )
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        for field in fields:
            _check_tensor(self._path, field, start_offs, int(self.alignment), len(self.data))
        super()._build_tensors(start_offs, fields)


def _check_tensor(path: Path, field: ReaderField, data_start: int, alignment: int, size: int):
    """Refuses a tensor table entry MLX cannot read, or whose data is not inside the file."""
    name = field.name
    _, _, num_dims, dims, raw_type, offset = field.parts
    if not 1 <= int(num_dims[0]) <= _MAX_DIMS:
        raise _invalid(path, f"tensor {name!r} has {int(num_dims[0])} dimensions")
    kind = int(raw_type[0])
    if kind not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
        raise UnsupportedFormatError(
            f"{path.name}: tensor {name!r} has GGUF type {kind}; supported: {supported}. "
            "Use a Q8_0, Q4_0, Q4_1 or F16 file"
        )
    kind = GGMLQuantizationType(kind)
    block, block_bytes = GGML_QUANT_SIZES[kind]
    shape = [int(d) for d in dims]
    elements = math.prod(shape)
    if shape[0] % block or elements == 0:
        raise _invalid(path, f"tensor {name!r} of type {kind.name} has shape {shape}")
    start = int(offset[0])
    if start % alignment:
        raise _invalid(path, f"tensor {name!r} starts at {start}, not a multiple of {alignment}")
    if data_start + start + elements // block * block_bytes > size:
        raise _invalid(path, f"tensor {name!r} ends past the end of the file (truncated?)")


# GGUF metadata value types by their size in bytes; 8 is a string, 9 an array.
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def tensor_elements(path: Path) -> int:
    """The number of weight values in a GGUF file's tensors (what its conversion dequantizes),
    from its tensor table. The metadata before it is skipped by its lengths, not decoded:
    `GGUFReader` builds an array per vocabulary string (seconds for 49k tokens, too slow for a
    listing or a budget check).

    Raises:
        UnsupportedFormatError: as `read_metadata`, for a header or table past the file's end.
    """
    _check_header(path)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            _, _, num_tensors, num_keys = _HEADER.unpack_from(data)
            at = _HEADER.size
            for _ in range(num_keys):
                at = _skip_string(data, at)
                (kind,) = struct.unpack_from("<I", data, at)
                at = _skip_value(data, at + 4, kind)
            elements = 0
            for _ in range(num_tensors):
                at = _skip_string(data, at)
                (num_dims,) = struct.unpack_from("<I", data, at)
                dims = struct.unpack_from(f"<{min(num_dims, _MAX_DIMS + 1)}Q", data, at + 4)
                elements += math.prod(dims)
                at += 4 + 8 * num_dims + 4 + 8  # dims, then its type and offset
        except (struct.error, KeyError, ValueError) as error:
            raise _invalid(path, f"its metadata or tensor table ends early ({error})") from error
    return elements


def _skip_string(data: mmap.mmap, at: int) -> int:
    (length,) = struct.unpack_from("<Q", data, at)
    if at + 8 + length > len(data):
        raise ValueError(f"a string of {length} bytes at byte {at}")
    return at + 8 + length


def _skip_value(data: mmap.mmap, at: int, kind: int) -> int:
    if kind == _STRING:
        return _skip_string(data, at)
    if kind != _ARRAY:
        return at + _VALUE_BYTES[kind]
    item_kind, count = struct.unpack_from("<IQ", data, at)
    at += 12
    if count > len(data) - at:  # every item takes at least a byte
        raise ValueError(f"an array of {count} items at byte {at}")
    if item_kind in _VALUE_BYTES:
        return at + count * _VALUE_BYTES[item_kind]
    for _ in range(count):
        at = _skip_value(data, at, item_kind)
    return at
