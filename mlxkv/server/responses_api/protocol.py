"""The Responses API's request body as pydantic models, and its translation into chat-template
messages and tools.

`input` is a string or a list of items: messages (roles user, assistant, system, developer;
content a string or `input_text`/`output_text` parts), `function_call` and
`function_call_output` (the assistant's tool calls and their results, matched by `call_id`);
an `item_reference` is replaced by the stored output item it names before (`history`).
A `reasoning` item's text (`reasoning_text` content; a summary or encrypted content alone
is not the model's thinking) is the `reasoning_content` of the assistant turn after it;
other items a local model cannot use are dropped. `instructions` is the
system message. Tools of type `function` go to the chat template, as do those inside a
`namespace` group; hosted tools (`web_search`, `local_shell`, `custom`, ...) are dropped with
one log line per kind.

Reference: https://platform.openai.com/docs/api-reference/responses/create
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Literal

from pydantic import Field

from mlxkv.server.errors import ApiError
from mlxkv.server.images import image_part, parts_or_text
from mlxkv.server.protocol import Lenient, mlx_seed, nucleus, tool_arguments
from mlxkv.server.reply.forced_tools import ForcedCall
from mlxkv.server.reply.structured import openai_grammar
from mlxkv.server.reply.thinking_switch import effort_switches

logger = logging.getLogger(__name__)


class InputPart(Lenient):
    type: str
    text: str | None = None
    image_url: str | None = None  # input_image: a data: URL (a file_id is not supported)


class InputItem(Lenient):
    """One item of `input`; which fields matter depends on `type`."""

    type: str = "message"  # a bare {"role", "content"} is a message
    id: str | None = None  # the item an `item_reference` names
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    name: str | None = None
    arguments: str | dict[str, Any] | None = None
    call_id: str | None = None
    output: str | list[InputPart] | None = None


class ResponseTool(Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[ResponseTool] | None = None  # a namespace's functions


class NamedFunction(Lenient):
    type: Literal["function"]
    name: str


class TextOptions(Lenient):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(Lenient):
    effort: str | None = None


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stream: bool = False
    store: bool = True
    background: bool = False  # made without the request waiting (`background`)
    previous_response_id: str | None = Field(None, max_length=128)
    conversation: str | dict[str, Any] | None = None  # an id, or {"id": ...}
    prompt_cache_key: str | None = Field(None, max_length=256)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    safety_identifier: str | None = None
    user: str | None = None

    def logprobs_asked(self) -> int | None:
        """How many alternatives each output token's log-probability comes with, when
        `include` asks for them (OpenAI gives none otherwise, whatever `top_logprobs`)."""
        asked = "message.output_text.logprobs" in (self.include or [])
        return (self.top_logprobs or 0) if asked else None

    def settings(self) -> dict[str, Any]:
        """The settings a response repeats (OpenAI's response object: all of them, the
        values used where the request gave none: the Runner's greedy default, no penalty).
        `truncation` is "disabled" however asked: a prompt over the window is refused, never
        cut; `text.verbosity` is echoed, not followed (no local model is trained on it)."""
        effort = self.reasoning.effort if self.reasoning else None
        text_format = self.text.format if self.text and self.text.format else {"type": "text"}
        verbosity = self.text.verbosity if self.text and self.text.verbosity else "medium"
        return {
            "temperature": 0.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "top_logprobs": self.top_logprobs or 0,
            "text": {"format": text_format, "verbosity": verbosity},
            "reasoning": {"effort": effort, "summary": None},
            "truncation": "disabled",
            "max_tool_calls": self.max_tool_calls,
            "background": self.background,
            "service_tier": "default",
            "metadata": self.metadata or {},
            "safety_identifier": self.safety_identifier,
            "prompt_cache_key": self.prompt_cache_key,
            "user": self.user,
            "tools": [_echoed_tool(tool) for tool in self.tools or []],
        }

    def template_switches(self) -> dict[str, Any] | None:
        return effort_switches(self.reasoning.effort if self.reasoning else None)

    def system_messages(self) -> list[dict[str, Any]]:
        """`instructions` as the chat's system message, before any history."""
        return [{"role": "system", "content": self.instructions}] if self.instructions else []

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [InputItem(type="message", role="user", content=self.input)]
        return self.input

    def template_tools(self) -> list[dict[str, Any]] | None:
        """Function tools for the chat template, as `tool_choice` narrows them."""
        if not self.tools or self.tool_choice == "none":
            return None
        tools = [_template_tool(t) for t in _functions(self.tools)]
        if isinstance(self.tool_choice, NamedFunction):
            name = self.tool_choice.name
            tools = [t for t in tools if t["function"]["name"] == name]
            if not tools:
                raise ApiError(
                    400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
                )
        return tools or None

    def forced_call(self) -> ForcedCall | None:
        """The call `tool_choice` requires ("required", or a named function), if any."""
        if isinstance(self.tool_choice, NamedFunction):
            return ForcedCall(self.tool_choice.name)
        return ForcedCall() if self.tool_choice == "required" else None

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        chosen = {
            "max_tokens": self.max_output_tokens or default_max_tokens,
            "temperature": self.temperature,
            **nucleus(self.top_p, self.top_k),
            "min_p": self.min_p,
            "seed": mlx_seed(self.seed),
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "grammar": openai_grammar(self.text.format if self.text else None, "text.format"),
        }
        return {key: value for key, value in chosen.items() if value is not None}


def chat_messages(
    instructions: str | None, items: list[InputItem], field: str = "input"
) -> list[dict[str, Any]]:
    """Chat-template messages for `instructions` and `items` (`field`: the request's field that
    holds them, for errors)."""
    out: list[dict[str, Any]] = []
    dropped: set[str] = set()
    reasoning = ""  # read, for the next assistant turn
    if instructions:
        out.append({"role": "system", "content": instructions})
    for index, item in enumerate(items):
        where = f"{field}[{index}]"
        if item.type == "reasoning":
            reasoning += _text(item.content, where)
        elif item.type == "message":
            if item.role is None:
                raise ApiError(400, f"{where} is a message without a role", param=where)
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _content(item.content, where)})
        elif item.type == "function_call":
            if not item.name or not item.call_id:
                raise ApiError(
                    400, f"{where} is a function_call without name or call_id", param=where
                )
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": tool_arguments(item.arguments, where)},
            }
            if out and out[-1]["role"] == "assistant":  # parallel calls share one turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            if not item.call_id:
                raise ApiError(
                    400, f"{where} is a function_call_output without call_id", param=where
                )
            content = _text(item.output, where)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
        else:
            dropped.add(item.type)
        if reasoning and item.type != "reasoning":  # the turn it belongs to, or none
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("reasoning_content", reasoning)
            reasoning = ""
    _note_dropped("input items", dropped)
    return out


def _text(content: str | list[InputPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    kinds = sorted({p.type for p in content if p.type not in _TEXT_PARTS})
    if kinds:
        raise ApiError(
            400,
            f"{where} has content of type {', '.join(kinds)}; this server takes text only",
            param=where,
        )
    return "".join(part.text or "" for part in content)


def _content(content: str | list[InputPart] | None, where: str) -> str | list[dict[str, Any]]:
    """A message's content: its text, or its text and `input_image` parts in order."""
    if content is None or isinstance(content, str) or all(p.type != "input_image" for p in content):
        return _text(content, where)
    parts = []
    for j, part in enumerate(content):
        if part.type == "input_image":
            parts.append(image_part(part.image_url or "", f"{where}.content[{j}].image_url"))
        else:
            parts.append({"type": "text", "text": _text([part], where)})
    return parts_or_text(parts)


_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")


def _functions(tools: list[ResponseTool]) -> list[ResponseTool]:
    out, dropped = [], set()
    for tool in tools:
        if tool.type == "function" and tool.name:
            out.append(tool)
        elif tool.type == "namespace" and tool.tools:
            out += [t for t in tool.tools if t.type == "function" and t.name]
        else:
            dropped.add(tool.type)
    _note_dropped("tools", dropped)
    return out


def _template_tool(tool: ResponseTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _note_dropped(what: str, kinds: set[str]) -> None:
    """One line per request at most, and only for a combination not seen lately (Codex sends
    the same hosted tools every turn; a client inventing kinds cannot flood the log)."""
    if kinds:
        _log_dropped(what, tuple(sorted(kinds)[:5]), len(kinds))


@functools.lru_cache(maxsize=64)
def _log_dropped(what: str, kinds: tuple[str, ...], count: int) -> None:
    more = f" and {count - len(kinds)} more" if count > len(kinds) else ""
    shown = ", ".join(repr(kind[:40]) for kind in kinds)
    logger.info(
        "responses: %s of type %s%s dropped (not something a local model runs)", what, shown, more
    )


def _echoed_tool(tool: ResponseTool) -> dict[str, Any]:
    """A tool as a response lists it: a function's `strict` false unless asked (its
    arguments are not held to its schema unless a call is required)."""
    echoed = tool.model_dump(exclude_none=True)
    if tool.type == "function":
        echoed.setdefault("strict", False)
    return echoed
