"""Anthropic's Messages API request bodies as pydantic models, and their translation into
chat-template messages: `tool_use` blocks become the assistant's tool calls, `tool_result`
blocks become `tool` messages, and tools become OpenAI-style function definitions (the form
chat templates take).

`output_config.format` (or the beta's top-level `output_format`) is honoured (structured
outputs), and `thinking` sets the chat template's thinking switch where it has one
(`reply.thinking_switch`). Fields current clients send that change nothing here are accepted
and ignored: `output_config.effort`,
`cache_control` (every prefix is cached anyway), `context_management`, `diagnostics`,
`metadata`, `anthropic-beta` headers.

Reference: https://docs.anthropic.com/en/api/messages
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from mlxkv.runner.text.chat import CONTINUE_FINAL
from mlxkv.server.anthropic_api.diagnostics import Origin
from mlxkv.server.anthropic_api.tool_ids import model_id
from mlxkv.server.errors import ApiError
from mlxkv.server.images import image_part, parts_or_text
from mlxkv.server.protocol import Lenient, nucleus
from mlxkv.server.reply.forced_tools import ForcedCall
from mlxkv.server.reply.structured import anthropic_grammar
from mlxkv.server.reply.thinking_switch import anthropic_switches, merged


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MediaBlock(Lenient):
    """An image (base64, or a URL, which is not fetched) or a document (refused: text only).
    `source` as Anthropic sends it: {"type": "base64", "media_type", "data"} or
    {"type": "url", "url"}."""

    type: Literal["image", "document"]
    source: dict[str, Any] | None = None

    def image(self, where: str) -> dict[str, Any]:
        """The runner's image part, or a 400 for a document or a source without data."""
        source = self.source or {}
        if self.type != "image":
            raise ApiError(400, f"{where}: {self.type} blocks are not supported; send text only")
        if source.get("type") == "base64":
            media = source.get("media_type") or "image/png"
            return image_part(f"data:{media};base64,{source.get('data') or ''}", where)
        return image_part(source.get("url") or "", where)


ResultPart = Annotated[TextBlock | MediaBlock, Field(discriminator="type")]


class ToolResultBlock(Lenient):
    """A tool's result: text, or text and images (Claude Code's Read of a screenshot, an MCP
    browser tool's capture), which go to the template's `tool` message as image parts."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] | None = None
    is_error: bool = False


class ThinkingBlock(Lenient):
    """Reasoning from an earlier turn: its text goes to the template as the message's
    `reasoning_content` (templates that render it, as Qwen3's does for the turns of the
    current tool loop, then match what was generated); a redacted one has none."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | MediaBlock | ThinkingBlock,
    Field(discriminator="type"),
]


class Message(Lenient):
    """A turn; Claude Code also sends `system` messages between turns (reminders), rendered
    in place so that the prefix before them stays what the cache holds."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class ThreadParam(Lenient):
    """Anthropic's message threads beta: `create` keeps the conversation under the reply's id,
    `continue` sends the turn after `previous_message_id` alone (`anthropic_api.threads`)."""

    type: Literal["create", "continue"]
    previous_message_id: str | None = None


class PromptFields(Lenient):
    """What `/v1/messages` and `/v1/messages/count_tokens` share: the prompt."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # the template's thinking switch, where it has one
    # `previous_message_id` asks for `diagnostics.cache_miss_reason` (anthropic_api.diagnostics)
    diagnostics: dict[str, Any] | None = None
    # As vLLM's: the request's cache domain (and replies generated within it: the prompt's ids)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    thread: ThreadParam | None = None

    def template_switches(self) -> dict[str, Any] | None:
        """The thinking switch, and Anthropic's prefill: a last assistant message is
        continued, the reply its rest (a no-op for any other last message)."""
        return merged(anthropic_switches(self.thinking), {CONTINUE_FINAL: True})

    def chat_messages(self) -> list[dict[str, Any]]:
        return self.chat_messages_with_origins()[0]

    def chat_messages_with_origins(self) -> tuple[list[dict[str, Any]], list[Origin]]:
        """The chat-template messages, and where each came from: ("system", None), or the
        index of the request's message and of its content block (None where several blocks
        make one template message, or the content is a string)."""
        out: list[dict[str, Any]] = []
        origins: list[Origin] = []
        system = self.system_text()
        if system:
            out.append({"role": "system", "content": system})
            origins.append(("system", None))
        for index, message in enumerate(self.messages):
            produced = _template_messages(index, message)
            out += produced
            origins += _origins(index, message, len(produced))
        return out, origins

    def system_text(self) -> str | None:
        system = self.system
        if isinstance(system, list):
            system = "\n\n".join(
                block.text for block in system if not block.text.startswith(_PER_SESSION_HEADER)
            )
        return system

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template, as `tool_choice` narrows them."""
        choice = self.tool_choice
        if not self.tools or (choice and choice.type == "none"):
            return None
        tools = self.tools
        if choice and choice.type == "tool":
            tools = [tool for tool in tools if tool.name == choice.name]
            if not tools:
                raise ApiError(400, f"tool_choice names {choice.name!r}, which is not in tools")
        return [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description or "",
                    "parameters": tool.input_schema,
                },
            }
            for tool in tools
        ]

    def forced_call(self) -> ForcedCall | None:
        """The call `tool_choice` requires (`any`, or a named `tool`), if any."""
        choice = self.tool_choice
        if choice is None or choice.type not in ("any", "tool"):
            return None
        return ForcedCall(choice.name if choice.type == "tool" else None)


class MessagesRequest(PromptFields):
    max_tokens: int = Field(ge=0)  # 0: only put the prompt in the cache (pre-warming)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    output_config: dict[str, Any] | None = None  # `format` is honoured, `effort` ignored
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's `format`

    def sampling(self) -> dict[str, Any]:
        if self.stop_sequences is not None and not all(self.stop_sequences):
            raise ApiError(400, "stop_sequences must not contain empty strings")
        chosen = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            **nucleus(self.top_p, self.top_k),
            "stop": self.stop_sequences,
            "grammar": anthropic_grammar(self.output_config, self.output_format),
        }
        return {key: value for key, value in chosen.items() if value is not None}


def _template_messages(index: int, message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking or "")
        elif isinstance(block, MediaBlock):
            parts.append(block.image(f"messages.{index}.content.{j}"))
        elif isinstance(block, ToolUseBlock):
            _expect_role(index, message, "assistant", block.type)
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": model_id(block.id), "type": "function", "function": function})
        elif isinstance(block, ToolResultBlock):
            _expect_role(index, message, "user", block.type)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": model_id(block.tool_use_id),
                    "content": _result_content(block, f"messages.{index}.content.{j}"),
                }
            )
    if parts or calls or not out:
        reply: dict[str, Any] = {"role": message.role, "content": parts_or_text(parts)}
        if calls:
            reply["tool_calls"] = calls
        if any(thoughts) and message.role == "assistant":
            reply["reasoning_content"] = "".join(thoughts)
        out.append(reply)
    return out


def _origins(index: int, message: Message, count: int) -> list[Origin]:
    """Where `_template_messages` got its `count` messages: one per tool_result block, in
    order, then the rest of the message (its block when it is one block)."""
    if isinstance(message.content, str):
        return [(index, None)] * count
    results = [i for i, b in enumerate(message.content) if isinstance(b, ToolResultBlock)]
    rest = [i for i, b in enumerate(message.content) if not isinstance(b, ToolResultBlock)]
    origins: list[Origin] = [(index, i) for i in results]
    while len(origins) < count:
        origins.append((index, rest[0] if len(rest) == 1 else None))
    return origins[:count]


# Claude Code's first system block: its version and a per-session hash, different in every
# session. Rendered, it would make a new session miss the cache on its whole system prompt.
_PER_SESSION_HEADER = "x-anthropic-billing-header:"


def _expect_role(index: int, message: Message, role: str, block_type: str) -> None:
    if message.role != role:
        raise ApiError(400, f"messages.{index}: {block_type} blocks belong in {role} messages")


def _result_content(block: ToolResultBlock, where: str) -> str | list[dict[str, Any]]:
    """The tool message's content: the result's text, or its parts where it holds an image."""
    content = block.content if isinstance(block.content, list) else None
    if content is None:
        parts = [{"type": "text", "text": block.content or ""}]
    else:
        parts = [
            part.image(f"{where}.content.{k}")
            if isinstance(part, MediaBlock)
            else {"type": "text", "text": part.text}
            for k, part in enumerate(content)
        ]
    if block.is_error:
        parts.insert(0, {"type": "text", "text": "Error: "})
    return parts_or_text(parts)
