"""Ollama's request bodies as pydantic models, and their translation into Runner arguments.

`options` map onto sampling (`temperature`, `top_p`, `top_k`, `min_p`, `repeat_penalty`,
`presence_penalty`, `frequency_penalty`, `seed`, `stop`, `num_predict`: -1 or -2 for "until
the window is full"); options that size or
schedule Ollama's own runner (`num_ctx`, `num_gpu`, `num_thread`, ...) are accepted and
ignored. `keep_alive` is read where the model is held (`mlxkv.server.models.served`: when a
model loaded on demand unloads); a zero one with nothing to generate, an unload, is answered
as Ollama answers it, and one Ollama refuses is a 400 with its message (`keep_alive`).
Streaming is Ollama's default. Tool-call ids that
clients send back (Open WebUI does: `tool_calls[].id`, `tool_call_id`) reach the template as
they do through the OpenAI API.

Reference: https://github.com/ollama/ollama/blob/main/docs/api.md
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxkv.runner.text.chat import CONTINUE_FINAL
from mlxkv.server.errors import ApiError
from mlxkv.server.images import image_part, parts_or_text
from mlxkv.server.models.keep_alive import keep_alive_ns
from mlxkv.server.protocol import mlx_seed, nucleus, tool_arguments
from mlxkv.server.reply.structured import ollama_grammar
from mlxkv.server.reply.thinking_switch import merged, ollama_switches


class Lenient(BaseModel):
    """Types as Ollama's Go server reads them (a number may be given as an integer), unknown
    fields ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class Options(Lenient):
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    num_predict: int | None = Field(None, ge=-2)


class Function(Lenient):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(Lenient):
    id: str | None = None
    function: Function


class Message(Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    thinking: str | None = None  # an earlier reply's, for templates that render it


class GenerationRequest(Lenient):
    model: str = ""
    options: Options | None = None
    stream: bool = True
    keep_alive: Any = None  # as sent: read as Ollama reads it (`unloads`)
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None  # the template's thinking switch, where it has one

    def template_switches(self) -> dict[str, Any] | None:
        return ollama_switches(self.think)

    @property
    def unloads(self) -> bool:
        """`keep_alive` zero (a number of seconds, or a Go duration: "0", "0s", "0m0s"): Ollama's
        way to unload a model, with no prompt (a model loaded on demand unloads as the
        request ends; one loaded at start stays).

        Raises:
            ApiError: 400 with Ollama's message for a keep_alive Ollama refuses ("00", "5 m",
                true); the routes read this first, so that any request carrying one is
                refused, as Ollama refuses it when it reads the body.
        """
        try:
            return keep_alive_ns(self.keep_alive) == 0
        except ValueError as error:
            raise ApiError(400, str(error), param="keep_alive") from error

    @property
    def split_thinking(self) -> bool:
        """Ollama's reading: thinking comes apart (`thinking`) unless `think` is false; a
        thinking model's default is on, and `false` leaves the text as generated."""
        return self.think is not False

    def sampling(self, default_max_tokens: int, window: int) -> dict[str, Any]:
        """Runner sampling arguments. num_predict -1 (no limit) and -2 (fill the context) both
        generate until the window is full. A num_predict is a cap, as in Ollama, never a
        demand: a reply it does not fit after ends when the window is full (`done_reason:
        "length"`), never a 400 (Open WebUI asks 1000 for a title whatever the history's
        length)."""
        options = self.options or Options()
        limit = options.num_predict if options.num_predict and options.num_predict > 0 else None
        unlimited = options.num_predict in (-1, -2)
        chosen = {
            "max_tokens": limit or (window if unlimited else default_max_tokens),
            "temperature": options.temperature,
            **nucleus(options.top_p, options.top_k),
            "min_p": options.min_p,
            "repetition_penalty": options.repeat_penalty,
            "presence_penalty": options.presence_penalty,
            "frequency_penalty": options.frequency_penalty,
            "seed": mlx_seed(options.seed),
            "stop": options.stop or None,
            "grammar": ollama_grammar(self.format),
        }
        return {k: v for k, v in chosen.items() if v is not None}


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def template_switches(self) -> dict[str, Any] | None:
        """The thinking switch, and, as Ollama does, a last assistant message continued (the
        reply its rest)."""
        return merged(super().template_switches(), {CONTINUE_FINAL: True})

    def chat_messages(self) -> list[dict[str, Any]]:
        out = []
        for index, message in enumerate(self.messages):
            where = f"messages[{index}]"
            content = _with_images(message.content, message.images, f"{where}.images")
            entry: dict[str, Any] = {"role": message.role, "content": content}
            if message.tool_calls:
                entry["tool_calls"] = [
                    {
                        **({"id": call.id} if call.id else {}),
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": tool_arguments(call.function.arguments, where),
                        },
                    }
                    for call in message.tool_calls
                ]
            if message.tool_name:
                entry["name"] = message.tool_name
            if message.tool_call_id:
                entry["tool_call_id"] = message.tool_call_id
            if message.thinking and message.role == "assistant":
                entry["reasoning_content"] = message.thinking
            out.append(entry)
        return out


class GenerateRequest(GenerationRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None
    suffix: str | None = None

    def prompt_for_runner(self) -> str | list[dict[str, Any]]:
        """Text as given (`raw`), else a chat of the system and the prompt."""
        if self.suffix:
            raise ApiError(400, "suffix (fill in the middle) is not supported; leave it out")
        if self.raw:
            if self.images:
                raise ApiError(400, "a raw prompt cannot hold images; leave raw out to send them")
            return self.prompt
        system = [{"role": "system", "content": self.system}] if self.system else []
        content = _with_images(self.prompt, self.images, "images")
        return [*system, {"role": "user", "content": content}]


def _with_images(text: str, images: list[str] | None, where: str) -> str | list[dict[str, Any]]:
    """A message's content with Ollama's `images` (base64) before its text, as Ollama
    places them."""
    if not images:
        return text
    parts = [image_part(image, f"{where}[{i}]") for i, image in enumerate(images)]
    return parts_or_text([*parts, {"type": "text", "text": text}])


class ModelRequest(Lenient):
    model: str = ""
    name: str = ""  # older clients' field
    stream: bool = True

    @property
    def model_name(self) -> str:
        return self.model or self.name
