"""Images a user passes, decoded and checked before any model work, and keyed by their pixels.

Owns: `DecodedImage` (RGB pixels and their digest), `decode_image` (path, bytes, base64 or
data: URL, or a PIL image; limits on bytes and pixels, the pixel limit checked from the header
before decoding, so a decompression bomb never expands) and the limits themselves. Does not own
fetching http(s) URLs (the server) nor what a model does with the pixels (`vision`).

Terms:
  - digest: sha256 of the decoded RGB pixels and their size, so the same picture sent as PNG,
    JPEG-free re-encodings or through another URL keys the same cache entries.

Imports Pillow only when an image is decoded (the `vision` extra).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Limits on one image: the encoded bytes, and width x height (checked before decoding).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 40_000_000
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]+", re.ASCII)
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<b64>;base64)?,", re.ASCII)


@dataclass(frozen=True)
class DecodedImage:
    """One decoded image.

    Attributes:
        image: a PIL image in RGB mode, fully loaded.
        digest: hex sha256 of its size and pixels.
    """

    image: Any
    digest: str


def decode_image(source: Any, *, max_bytes: int = MAX_IMAGE_BYTES) -> DecodedImage:
    """Decodes an image given as a PIL image, raw bytes, a path (str or Path), a base64 string
    or a `data:` URL.

    Raises:
        ValueError: broken base64, a format outside `ACCEPTED_FORMATS`, bytes over `max_bytes`,
            more than `MAX_IMAGE_PIXELS` pixels (before decoding), or a file that is missing
            or not an image; the message says which.
    """
    from PIL import Image

    if isinstance(source, Image.Image):
        return _finish(source)
    data = _encoded_bytes(source, max_bytes)
    if len(data) > max_bytes:
        raise ValueError(f"image is {len(data):,} bytes; the limit is {max_bytes:,} bytes")
    try:
        with Image.open(io.BytesIO(data)) as opened:  # reads the header only
            if opened.format not in ACCEPTED_FORMATS:
                raise ValueError(
                    f"image format {opened.format} is not supported; "
                    f"send one of {', '.join(ACCEPTED_FORMATS)}"
                )
            _check_pixels(*opened.size)
            opened.load()
            return _finish(opened)
    except Image.UnidentifiedImageError:  # its message is the repr of our in-memory file
        raise ValueError(
            "could not decode the image: its bytes are not an image of a known format; "
            f"send one of {', '.join(ACCEPTED_FORMATS)}"
        ) from None
    except (Image.DecompressionBombError, OSError) as error:
        raise ValueError(f"could not decode the image: {error}") from None


def _encoded_bytes(source: Any, max_bytes: int) -> bytes:
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source)
    if isinstance(source, Path) or (isinstance(source, str) and _looks_like_path(source)):
        path = Path(source)
        if not path.is_file():
            raise ValueError(
                f"image file {str(path)!r} does not exist (a str image is a path, base64 or a "
                "data: URL)"
            )
        if path.stat().st_size > max_bytes:
            raise ValueError(
                f"image file is {path.stat().st_size:,} bytes; the limit is {max_bytes:,} bytes"
            )
        return path.read_bytes()
    if isinstance(source, str):
        return _base64_bytes(source, max_bytes)
    raise ValueError(
        "an image must be a path, bytes, a base64 or data: URL string, or a PIL.Image; "
        f"got {type(source).__name__}"
    )


def _looks_like_path(text: str) -> bool:
    """A path, not base64: a file that exists, or text with a character base64 lacks (short
    base64 may hold "/", so that alone decides nothing)."""
    if text.startswith("data:") or len(text) >= 4096:
        return False
    return Path(text).is_file() or _BASE64.fullmatch(text) is None


def _base64_bytes(text: str, max_bytes: int) -> bytes:
    match = _DATA_URL.match(text)
    if match is not None:
        if not match.group("b64"):
            raise ValueError("a data: URL image must be base64 (data:image/png;base64,...)")
        text = text[match.end() :]
    if len(text) > max_bytes * 4 // 3 + 4:  # refused before decoding the base64 itself
        raise ValueError(f"image is over {max_bytes:,} bytes; the limit is {max_bytes:,} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image is not valid base64") from None


def _check_pixels(width: int, height: int) -> None:
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"image is {width}x{height} = {width * height:,} pixels; the limit is "
            f"{MAX_IMAGE_PIXELS:,} pixels"
        )


def _finish(image: Any) -> DecodedImage:
    _check_pixels(*image.size)
    rgb = image.convert("RGB")
    digest = hashlib.sha256(f"{rgb.size[0]}x{rgb.size[1]}\n".encode())
    digest.update(rgb.tobytes())
    return DecodedImage(rgb, digest.hexdigest())
