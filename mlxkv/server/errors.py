"""Errors as each API shapes them, so clients show the message instead of failing to parse.

Owns: `ApiError` (raised by routes for a request that cannot be served) and the three bodies:
OpenAI's `{"error": {"message", "type", "param", "code"}}`, Anthropic's
`{"type": "error", "error": {"type", "message"}}` and Ollama's `{"error": "message"}`. Which
one a response uses depends on the path (`/v1/messages...` is Anthropic's, `/api/...`
Ollama's) and, on a path two APIs share (`/v1/models...`), on the client: Anthropic's send
`anthropic-version`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

from mlxkv.errors import ContextLengthError, ModelNamedError

# Any other status is an `invalid_request_error`, a 404 too (OpenAI's unknown model is one).
_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "requests",  # OpenAI's type for rate limits; the code says rate_limit_exceeded
    500: "server_error",
    503: "server_error",
}
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """A request the server refuses, with the HTTP status and a message that says what to fix.

    Attributes:
        code: OpenAI's machine-readable code (e.g. "context_length_exceeded"), or None.
        param: the request field at fault, or None.
        headers: response headers (Retry-After), or None.
        details: Anthropic's `error.details` (its `error_code`, which the SDKs act on), or None.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        details: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers
        self.details = details


def context_length_error(error: ContextLengthError, path: str) -> ApiError:
    """A request over the window as a 400 in the wording each API's clients parse (Claude
    Code compacts its history or lowers max_tokens from Anthropic's numbers; litellm, aider
    and others look for OpenAI's sentence and code). Both name the window as the real APIs
    do ("prompt is too long: 208310 tokens > 200000 maximum", "maximum context length is
    4097 tokens"); a prompt that fills the window exactly is over it by the one token the
    answer needs, worded as the prompt and that token."""
    prompt, window, asked = error.prompt_tokens, error.max_context, error.max_tokens
    if prompt is None or window is None:  # a window too small for keep or the last turn
        return ApiError(400, f"{error}; this server's context is set by --max-context")
    if asked is None and prompt <= window:  # no room left for the answer's first token
        asked = 1
    if is_anthropic_path(path):
        if asked is None:
            message = f"prompt is too long: {prompt} tokens > {window} maximum"
        else:
            message = (
                f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > "
                f"{window}, decrease input length or max_tokens and try again"
            )
        return ApiError(400, message)
    if asked is None:
        message = (
            f"This model's maximum context length is {window} tokens. However, your messages "
            f"resulted in {prompt} tokens. Please reduce the length of the messages."
        )
    else:
        message = (
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt + asked} tokens ({prompt} in the messages, {asked} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    return ApiError(400, message, code="context_length_exceeded", param="messages")


def bad_input_error(error: ValueError, model_name: str) -> ApiError:
    """Bad input as a 400; a model refused by name is named as the client named it
    (`model_name`: the served name), not by the file the server loaded it from."""
    if isinstance(error, ModelNamedError):
        return ApiError(400, error.for_model(model_name))
    return ApiError(400, str(error))


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def is_anthropic_request(scope: Mapping[str, Any]) -> bool:
    """Whether the request (an ASGI scope: its `path`, and its `headers` where known) is
    Anthropic's: on its paths, or on the models listing (a path OpenAI's clients call too)
    from a client that sends `anthropic-version`, as Anthropic's SDKs do."""
    path = scope["path"]
    if is_anthropic_path(path):
        return True
    headers = scope.get("headers", ())
    return path.startswith("/v1/models") and any(n == b"anthropic-version" for n, _ in headers)


def error_response(
    scope: Mapping[str, Any],
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    details: dict[str, Any] | None = None,
) -> JSONResponse:
    """The error in the shape of the API the request (an ASGI scope) belongs to."""
    error = ApiError(status, message, code=code, param=param, details=details)
    body: dict[str, Any]
    if is_ollama_path(scope["path"]):
        body = {"error": message}
    elif is_anthropic_request(scope):
        body = {"type": "error", "error": anthropic_error(error)}
    else:
        body = {"error": openai_error(error)}
    return JSONResponse(body, status_code=status, headers=headers)


def openai_error(error: ApiError) -> dict[str, Any]:
    """OpenAI's error object for `error`: its type from the status, in a response body and in
    a stream's error event alike."""
    kind = _OPENAI_TYPES.get(error.status, "invalid_request_error")
    return {"message": error.message, "type": kind, "param": error.param, "code": error.code}


def anthropic_error(error: ApiError) -> dict[str, Any]:
    """Anthropic's error object for `error` (the inner `error` of its body and stream event)."""
    kind = _ANTHROPIC_TYPES.get(error.status, "invalid_request_error")
    body = {"type": kind, "message": error.message}
    return body if error.details is None else {**body, "details": error.details}
