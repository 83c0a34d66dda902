"""Each API's thinking setting, as the chat-template switches a hybrid reasoning model reads
(Qwen3's `enable_thinking`, gpt-oss's `reasoning_effort`). The engine passes a switch only to
a template that reads it, so other models render as before.

- Anthropic `thinking.type`: enabled / disabled set `enable_thinking` true / false;
  adaptive leaves the template's default.
- OpenAI chat `reasoning_effort` (and Responses' `reasoning.effort`): "none" sets
  `enable_thinking` false, any other effort true, and `reasoning_effort` is passed as given;
  chat's `chat_template_kwargs` (vLLM's field) go in as given, over those.
- Ollama `think`: true / false, or a level ("low", ...) read as an effort.
"""

from __future__ import annotations

from typing import Any

from mlxkv.server.errors import ApiError

_ANTHROPIC = {"enabled": True, "disabled": False, "adaptive": None}


def anthropic_switches(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """`thinking: {"type": ...}`; adaptive leaves it to the template's default."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in _ANTHROPIC:
        raise ApiError(400, f"thinking.type {kind!r} is not one of enabled, disabled, adaptive")
    enabled = _ANTHROPIC[kind]
    return None if enabled is None else {"enable_thinking": enabled}


def effort_switches(effort: str | None) -> dict[str, Any] | None:
    """OpenAI's `reasoning_effort` ("none", "minimal", "low", "medium", "high", ...)."""
    if effort is None:
        return None
    return {"enable_thinking": effort != "none", "reasoning_effort": effort}


def ollama_switches(think: bool | str | None) -> dict[str, Any] | None:
    """Ollama's `think`: a bool, or a level ("low", "medium", "high")."""
    if think is None:
        return None
    if isinstance(think, str):
        return effort_switches(think)
    return {"enable_thinking": think}


def merged(*switches: dict[str, Any] | None) -> dict[str, Any] | None:
    """The switches, later ones over earlier ones; None when there are none."""
    out: dict[str, Any] = {}
    for more in switches:
        out.update(more or {})
    return out or None
