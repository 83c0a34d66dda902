"""Image parts from every API, in the one form the runner takes.

Owns `image_part` (an API's image reference -> `{"type": "image", "image": ...}`),
`parts_or_text` (a message's parts -> its text when it has no image, else the part list) and
`fetched_images` (http(s) image URLs replaced by their bytes where the operator allows
fetching, `--fetch-images`; refused otherwise: by default the server reaches out to no host a
request names). The runner decodes and checks the image (`mlxkv.models.images`): a bad one is a
ValueError the route turns into a 400 in its API's shape.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.error
import urllib.request
from typing import Any

from mlxkv.models.images import MAX_IMAGE_BYTES
from mlxkv.server.errors import ApiError

# The longest one image URL may take to answer and send its bytes.
FETCH_TIMEOUT_S = 10.0
_READ_BYTES = 2**16  # what one read may return: the deadline is checked between reads
_REMOTE = ("http://", "https://")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")  # base64 has no ':': a URL of some kind


def image_part(reference: str, where: str) -> dict[str, Any]:
    """An image given as a `data:` URL, bare base64 (made a data: URL, so the runner never
    takes a client's string for a file path on this machine) or an http(s) URL (fetched
    later, by `fetched_images`, where allowed)."""
    if not isinstance(reference, str) or not reference:
        raise ApiError(400, f"{where}: an image needs a data: URL or base64 data", param=where)
    if reference.startswith(("data:", *_REMOTE)):
        return {"type": "image", "image": reference}
    scheme = _SCHEME.match(reference)
    if scheme is not None:  # a file: or ftp: URL: never read, said so (not "bad base64")
        raise ApiError(
            400,
            f"{where}: a {scheme.group()} URL is not an image this server takes; send a data: "
            "URL (data:image/png;base64,...) or base64, or an http(s) URL with --fetch-images",
            param=where,
        )
    reference = f"data:application/octet-stream;base64,{reference}"
    return {"type": "image", "image": reference}


def parts_or_text(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content: its text parts joined when it holds no image (the template then
    sees the string it always saw), else the parts."""
    if any(part["type"] == "image" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


async def fetched_images(messages: Any, allowed: bool) -> Any:
    """Chat `messages` with each http(s) image URL replaced by the image's bytes (fetched off the
    event loop, within `MAX_IMAGE_BYTES` and `FETCH_TIMEOUT_S`).

    Raises:
        ApiError: 400 for a URL while fetching is off, or one that cannot be fetched.
    """
    if isinstance(messages, str) or not all(isinstance(m, dict) for m in messages):
        return messages  # a raw prompt holds no image parts
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(_is_remote(part) for part in content):
            parts = [await _fetched(part, allowed) for part in content]
            message = {**message, "content": parts}
        out.append(message)
    return out


def _is_remote(part: Any) -> bool:
    image = part.get("image") if isinstance(part, dict) else None
    return isinstance(image, str) and image.startswith(_REMOTE)


async def _fetched(part: dict[str, Any], allowed: bool) -> dict[str, Any]:
    if not _is_remote(part):
        return part
    if not allowed:
        raise ApiError(
            400,
            "image URLs are not fetched by this server; send the image inline as a data: URL "
            "(data:image/png;base64,...), or start the server with --fetch-images",
        )
    return {**part, "image": await asyncio.to_thread(_download, part["image"])}


def _download(url: str) -> bytes:
    """The bytes at `url`, read as they come against one deadline: urllib's timeout bounds
    each socket read only, so a host sending a byte at a time could hold a request for good."""
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    data = bytearray()
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:  # noqa: S310
            while len(data) <= MAX_IMAGE_BYTES and (chunk := response.read1(_READ_BYTES)):
                data += chunk
                if time.monotonic() > deadline:
                    raise ApiError(
                        400,
                        f"the image at {url} took over {FETCH_TIMEOUT_S:g} s to arrive "
                        f"({len(data):,} bytes by then); send it inline as a data: URL",
                    )
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise ApiError(400, f"could not fetch the image at {url}: {error}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ApiError(
            400,
            f"the image at {url} is over {MAX_IMAGE_BYTES:,} bytes; the limit is "
            f"{MAX_IMAGE_BYTES:,} bytes",
        )
    return bytes(data)
