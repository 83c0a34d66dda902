"""GGUF files built byte by byte: `read_metadata` reads valid ones through the `gguf` package
and refuses hostile ones with one clear error, quickly and without a large allocation (the
bounds `gguf.GGUFReader` lacks are added by `reader._BoundedReader`)."""

import inspect
import struct
import time

import pytest
from gguf import GGUFReader

from mlxkv import UnsupportedFormatError
from mlxkv.models.gguf.reader import read_metadata, tensor_elements

_U8, _I32, _U32, _F32, _BOOL, _STRING, _ARRAY, _U64 = 0, 5, 4, 6, 7, 8, 9, 10
_F32_TENSOR, _Q4_K_TENSOR = 0, 12


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _string(key) + struct.pack("<I", kind) + payload


def _tensor(name: str, dims: list[int], kind: int = _F32_TENSOR, offset: int = 0) -> bytes:
    shape = struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
    return _string(name) + shape + struct.pack("<IQ", kind, offset)


def _gguf(path, kvs=(), tensors=(), data=b"", *, version=3):
    header = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    header += b"".join(kvs) + b"".join(tensors)
    path.write_bytes(header + b"\0" * (-len(header) % 32) + data)
    return path


def test_valid_file_reads_back_every_value_type(tmp_path):
    path = _gguf(
        tmp_path / "ok.gguf",
        kvs=[
            _kv("a.u8", _U8, struct.pack("<B", 7)),
            _kv("a.i32", _I32, struct.pack("<i", -3)),
            _kv("a.f32", _F32, struct.pack("<f", 0.5)),
            _kv("a.bool", _BOOL, struct.pack("<?", True)),
            _kv("a.string", _STRING, _string("héllo")),
            _kv("a.strings", _ARRAY, struct.pack("<IQ", _STRING, 2) + _string("x") + _string("")),
            _kv("a.u32s", _ARRAY, struct.pack("<IQ3I", _U32, 3, 1, 2, 3)),
            _kv("a.empty", _ARRAY, struct.pack("<IQ", _U64, 0)),
        ],
        tensors=[_tensor("w", [4])],
        data=bytes(16),
    )
    assert read_metadata(path) == {
        "a.u8": 7,
        "a.i32": -3,
        "a.f32": 0.5,
        "a.bool": True,
        "a.string": "héllo",
        "a.strings": ["x", ""],
        "a.u32s": [1, 2, 3],
        "a.empty": [],
    }


@pytest.mark.parametrize(
    ("kind", "count"), [(_U8, 2**62), (_U32, 2**40), (_STRING, 2**61)], ids=["u8", "u32", "str"]
)
def test_array_count_past_the_end_is_refused_at_once(tmp_path, kind, count):
    """gguf's reader would loop `count` times over empty reads; the count is checked first."""
    path = _gguf(tmp_path / "a.gguf", kvs=[_kv("huge", _ARRAY, struct.pack("<IQ", kind, count))])
    start = time.monotonic()
    with pytest.raises(UnsupportedFormatError, match=f"a.gguf .*claims {count} elements"):
        read_metadata(path)
    assert time.monotonic() - start < 2


@pytest.mark.parametrize(
    ("kvs", "tensors", "data", "message"),
    [
        ([_kv("k", _STRING, struct.pack("<Q", 2**62) + b"x")], [], b"", "past the end of the file"),
        ([_string("k")[:-1]], [], b"", "past the end of the file"),
        ([_kv("k", 99, b"")], [], b"", "unknown type 99"),
        ([_kv("k", _ARRAY, struct.pack("<IQ", _ARRAY, 1))], [], b"", "elements of type 9"),
        ([_kv("k", _U8, b"\1"), _kv("k", _U8, b"\2")], [], b"", "Duplicate k"),
        ([_kv("k", _STRING, _string("x")[:-1] + b"\xff")], [], b"", "utf-8"),
        ([], [_tensor("w", [4, 1, 1, 1, 1])], bytes(16), "tensor 'w' has 5 dimensions"),
        ([], [_tensor("w", [])], bytes(16), "tensor 'w' has 0 dimensions"),
        ([], [_tensor("w", [4, 0])], bytes(16), r"tensor 'w' of type F32 has shape \[4, 0\]"),
        ([], [_tensor("w", [4], offset=3)], bytes(16), "starts at 3, not a multiple of 32"),
        ([], [_tensor("w", [4])], bytes(15), r"tensor 'w' ends past the end of the file"),
        ([], [_tensor("w", [2**40, 2**40])], bytes(16), "tensor 'w' ends past the end"),
    ],
    ids=[
        "string-length",
        "cut-key",
        "value-type",
        "nested-array",
        "duplicate-key",
        "not-utf8",
        "five-dims",
        "no-dims",
        "empty-shape",
        "misaligned",
        "truncated-data",
        "huge-shape",
    ],
)
def test_hostile_file_is_one_clear_error(tmp_path, kvs, tensors, data, message):
    path = _gguf(tmp_path / "bad.gguf", kvs=kvs, tensors=tensors, data=data)
    with pytest.raises(
        UnsupportedFormatError, match=f"bad.gguf is not a valid GGUF file: .*{message}"
    ):
        read_metadata(path)


@pytest.mark.parametrize("kind", [_Q4_K_TENSOR, 99], ids=["q4_k", "unknown"])
def test_tensor_type_mlx_cannot_read_is_named(tmp_path, kind):
    path = _gguf(tmp_path / "q.gguf", tensors=[_tensor("w", [256], kind)], data=bytes(256))
    with pytest.raises(
        UnsupportedFormatError,
        match=f"q.gguf: tensor 'w' has GGUF type {kind}; supported: F32, F16, Q4_0, Q4_1, Q8_0",
    ):
        read_metadata(path)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"GGUF\3\0\0", "the header needs 24 bytes"),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "version 50331648 is not 2 or 3"),  # big-endian
        (
            b"GGUF" + struct.pack("<IQQ", 3, 2**62, 0),
            "it claims 4611686018427387904 tensors and 0 metadata",
        ),
        (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 2**62),
            "it claims 0 tensors and 4611686018427387904 metadata",
        ),
        (b"GGU", "it starts with b'GGU', not b'GGUF'"),
    ],
    ids=["short", "big-endian", "tensor-count", "key-count", "tiny"],
)
def test_bad_header_is_refused_before_gguf_reads_it(tmp_path, header, message):
    path = tmp_path / "h.gguf"
    path.write_bytes(header)
    with pytest.raises(UnsupportedFormatError, match=f"h.gguf is not a valid GGUF file: {message}"):
        read_metadata(path)


def test_the_gguf_methods_bounded_here_keep_their_signatures():
    """`_BoundedReader` overrides private `GGUFReader` methods: a gguf release that renames them
    would quietly drop the bounds (and the hostile-count tests above would hang, not fail)."""
    expected = {
        "_get": ["self", "offset", "dtype", "count", "override_order"],
        "_get_field_parts": ["self", "orig_offs", "raw_type"],
        "_build_tensors": ["self", "start_offs", "fields"],
    }
    for name, parameters in expected.items():
        assert list(inspect.signature(getattr(GGUFReader, name)).parameters) == parameters, name


def test_tensor_elements_skim_the_metadata_and_count_every_tensor(tmp_path):
    """`tensor_elements` (the served model's size before it loads) counts what gguf's reader
    counts, and a table cut short or an array past the end is one clear error, at once."""
    strings = struct.pack("<IQ", _STRING, 2) + _string("x") + _string("yz")
    nested = struct.pack("<IQ", _ARRAY, 1) + struct.pack("<IQ2I", _U32, 2, 1, 2)
    kvs = [_kv("a.strings", _ARRAY, strings), _kv("a.nested", _ARRAY, nested)]
    kvs += [_kv("a.f32", _F32, struct.pack("<f", 0.5))]
    tensors = [_tensor("w", [4, 2]), _tensor("b", [4], offset=32)]
    path = _gguf(tmp_path / "ok.gguf", kvs=kvs, tensors=tensors, data=bytes(64))
    assert tensor_elements(path) == 12 == sum(int(t.n_elements) for t in GGUFReader(path).tensors)
    cut = _gguf(tmp_path / "cut.gguf", kvs=kvs, tensors=[_tensor("w", [4, 2])[:-6]])
    cut.write_bytes(cut.read_bytes().rstrip(b"\0"))
    with pytest.raises(UnsupportedFormatError, match="cut.gguf is not a valid GGUF file"):
        tensor_elements(cut)
    huge = _gguf(tmp_path / "huge.gguf", kvs=[_kv("h", _ARRAY, struct.pack("<IQ", _STRING, 2**61))])
    with pytest.raises(UnsupportedFormatError, match="huge.gguf is not a valid GGUF file"):
        tensor_elements(huge)
