"""Image parts from every API, in the one form the runner takes.

Owns `image_part` (an API's image reference -> `{"type": "image", "image": ...}`) and
`parts_or_text` (a message's parts -> its text when it has no image, else the part list).
The runner decodes and checks the image (`mlxkv.models.images`): a bad one is a ValueError the
route turns into a 400 in its API's shape. Remote URLs are not fetched: the server reaches out
to no host a request names.
"""

from __future__ import annotations

from typing import Any

from mlxkv.server.errors import ApiError


def image_part(reference: str, where: str) -> dict[str, Any]:
    """An image given as a `data:` URL or bare base64 (what clients inline). An http(s) URL
    is refused with a 400 saying how to send it instead."""
    if not isinstance(reference, str) or not reference:
        raise ApiError(400, f"{where}: an image needs a data: URL or base64 data", param=where)
    if reference.startswith(("http://", "https://")):
        raise ApiError(
            400,
            f"{where}: image URLs are not fetched by this server; send the image inline as a "
            "data: URL (data:image/png;base64,...)",
            param=where,
        )
    return {"type": "image", "image": reference}


def parts_or_text(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content: its text parts joined when it holds no image (the template then
    sees the string it always saw), else the parts."""
    if any(part["type"] == "image" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)
