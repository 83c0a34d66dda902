"""Request types every API's schemas share: `Lenient` (the base of every request model: strict
types, unknown fields ignored, null as the default), the readings of fields several APIs
have (`mlx_seed`, `tool_arguments`), and OpenAI's log-probability objects, which its chat
completions and Responses both answer with (`openai_logprobs`). Lives apart from every API
folder, so none imports another.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from mlxkv.server.errors import ApiError
from mlxkv.server.json_limits import MAX_JSON_DEPTH, json_depth, too_deep_message


def nucleus(top_p: float | None, top_k: int | None) -> dict[str, Any]:
    """A request's `top_p` and `top_k` as the runner takes them. A `top_p` of 0, the smallest
    nucleus, keeps the most likely token alone, as OpenAI and llama.cpp (Ollama) read it:
    `top_k` 1; mlx-lm and the Python API read 0 as no filter (it sampled from every token)."""
    if top_p == 0:
        return {"top_p": None, "top_k": 1}
    return {"top_p": top_p, "top_k": top_k}


def openai_logprobs(tokens: Iterable[Any]) -> list[dict[str, Any]]:
    """OpenAI's objects for generated tokens (`reply.turn.TokenInfo`s): each token's text,
    log-probability and UTF-8 bytes, with its most likely alternatives as `top_logprobs`."""
    return [
        {**_logprob(t.text, t.logprob), "top_logprobs": [_logprob(*alt) for alt in t.top]}
        for t in tokens
    ]


def _logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def mlx_seed(seed: int | None) -> int | None:
    """A client's seed as MLX takes it: the APIs take any integer, MLX an unsigned 64-bit."""
    return None if seed is None else seed % 2**64


class Lenient(BaseModel):
    """Strict types, unknown fields ignored; null for an optional field means its default
    (OpenAI's own reading: clients send `"stream": null`, `"n": null`)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required()
        }


def tool_arguments(arguments: str | dict[str, Any], where: str) -> dict[str, Any]:
    """A tool call's arguments as the object chat templates take; `where` names the field
    in errors ("messages[2]", "input[3]").

    Raises:
        ApiError: 400 for arguments that are not a JSON object, or nest too deeply.
    """
    if isinstance(arguments, dict):
        return arguments
    if (depth := json_depth(arguments)) > MAX_JSON_DEPTH:
        raise ApiError(400, too_deep_message(depth, f"{where}'s tool call arguments"), param=where)
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError as error:
        raise ApiError(
            400, f"{where} has tool call arguments that are not JSON ({error})", param=where
        ) from error
    if not isinstance(parsed, dict):
        raise ApiError(400, f"{where} has tool call arguments that are not an object", param=where)
    return parsed
