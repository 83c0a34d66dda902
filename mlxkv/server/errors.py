"""Errors as each API shapes them, so clients show the message instead of failing to parse.

Owns: `ApiError` (raised by routes for a request that cannot be served) and the two bodies:
OpenAI's `{"error": {"message", "type", "param", "code"}}` and Anthropic's
`{"type": "error", "error": {"type", "message"}}`. Which one a response uses depends only on
the path (`/v1/messages...` is Anthropic's).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 500: "server_error"}
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "api_error",
}


class ApiError(Exception):
    """A request the server refuses, with the HTTP status and a message that says what to fix.

    Attributes:
        code: OpenAI's machine-readable code (e.g. "context_length_exceeded"), or None.
        param: the request field at fault, or None.
    """

    def __init__(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(
    path: str,
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error in the shape of the API that `path` belongs to."""
    body: dict[str, Any]
    if is_anthropic_path(path):
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error")
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        kind = _OPENAI_TYPES.get(status, "invalid_request_error")
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
