"""OpenAI's request bodies as pydantic models: what `/v1/chat/completions` and
`/v1/completions` accept, checked strictly (a string where a number belongs is a 400, not a
guess). Fields clients send that do not change the answer (`user`, `metadata`, `store`, ...)
are accepted and ignored.

Owns the schemas and their translation into Runner arguments; the routes are in `routes.py`.
Reference: https://platform.openai.com/docs/api-reference/chat/create
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from mlxkv.runner.text.chat import CONTINUE_FINAL
from mlxkv.server.errors import ApiError
from mlxkv.server.images import image_part, parts_or_text
from mlxkv.server.protocol import Lenient, mlx_seed, nucleus, tool_arguments
from mlxkv.server.reply.forced_tools import ForcedCall
from mlxkv.server.reply.structured import openai_grammar
from mlxkv.server.reply.thinking_switch import effort_switches, merged


class ImageUrl(Lenient):
    url: str
    detail: str | None = None


class ContentPart(Lenient):
    type: str
    text: str | None = None
    image_url: ImageUrl | str | None = None


class FunctionCall(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # An earlier reply's thinking, sent back: templates that render it (Qwen3's, for the
    # turns of the current tool loop) get it, so the prompt matches what was generated.
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(Lenient):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(Lenient):
    include_usage: bool = False


class GenerationFields(Lenient):
    """What both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # token id (a decimal string in JSON) -> bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's field: reuse only cache entries made with the same salt (isolation)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    def sampling(self, max_tokens: int | None, default_max_tokens: int) -> dict[str, Any]:
        """Runner sampling arguments; checks what the schema cannot express."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and not all(stop):
            raise ApiError(400, "stop strings must not be empty", param="stop")
        chosen = {
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "temperature": self.temperature,
            **nucleus(self.top_p, self.top_k),
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": _token_biases(self.logit_bias),
            "seed": mlx_seed(self.seed),
            "stop": stop,
            "grammar": openai_grammar(self.response_format, "response_format"),
        }
        return {key: value for key, value in chosen.items() if value is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _token_biases(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as JSON object keys) keyed by int."""
    if bias is None:
        return None
    wrong = [key for key in bias if not key.isdecimal()]
    if wrong:
        raise ApiError(
            400,
            f"logit_bias keys must be token ids (integers), got {wrong[0]!r}",
            param="logit_bias",
        )
    return {int(key): value for key, value in bias.items()}


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # OpenAI's routing hint for its prompt cache: here the label of the entry the request
    # generates into (shown by /v1/mlxkv/cache); lookup stays by tokens.
    prompt_cache_key: str | None = Field(None, max_length=256)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = (
        None  # vLLM's: passed where the template reads them
    )

    # vLLM's: the last assistant message is continued, the reply its rest (a "prefill")
    continue_final_message: bool = False

    def template_switches(self) -> dict[str, Any] | None:
        continued = {CONTINUE_FINAL: True} if self.continue_final_message else None
        return merged(effort_switches(self.reasoning_effort), self.chat_template_kwargs, continued)

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them: text content, `developer` as `system`,
        tool-call arguments as objects (templates serialize them themselves)."""
        return [_template_message(i, m) for i, m in enumerate(self.messages)]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template, as `tool_choice` narrows them."""
        if not self.tools or self.tool_choice == "none":
            return None
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            tools = [t for t in tools if t["function"]["name"] == name]
            if not tools:
                raise ApiError(
                    400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
                )
        return tools

    def forced_call(self) -> ForcedCall | None:
        """The call `tool_choice` requires ("required", or a named function), if any."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return ForcedCall(self.tool_choice.function.name)
        return ForcedCall() if self.tool_choice == "required" else None

    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationFields):
    max_tokens: int | None = Field(16, ge=0)  # the legacy endpoint's documented default
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    # OpenAI samples this many completions and returns the n most likely: best_of = n returns
    # them all, which is what n alone does; more is not ranked here
    best_of: int | None = Field(None, ge=1)

    def prompts(self) -> list[str | list[int]]:
        """The prompts sent, each answered with `n` choices: one, or several (a list of
        texts or of token id lists, as lm-evaluation-harness batches them)."""
        if self.suffix:
            raise ApiError(400, "suffix is not supported; leave it out", param="suffix")
        if self.best_of not in (None, self.n):
            message = (
                f"best_of={self.best_of} is not supported; send best_of={self.n} (n) or leave it "
                "out"
            )
            raise ApiError(400, message, param="best_of")
        prompt = self.prompt
        several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
        prompts = list(prompt) if several else [prompt]
        if not prompt:
            raise ApiError(400, "prompt is empty", param="prompt")
        for index, each in enumerate(prompts):
            if not each:
                raise ApiError(400, f"prompt[{index}] is empty", param="prompt")
        return prompts


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": _text(index, message.content)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content or message.reasoning
    if reasoning and role == "assistant":
        out["reasoning_content"] = reasoning
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": tool_arguments(
                        call.function.arguments, f"messages[{index}].tool_calls"
                    ),
                },
            }
            for call in message.tool_calls
        ]
    return out


def _text(index: int, content: str | list[ContentPart] | None) -> str | list[dict[str, Any]]:
    """The content as the template takes it: text, or text and image parts."""
    if content is None or isinstance(content, str):
        return content or ""
    kinds = sorted({part.type for part in content if part.type not in ("text", "image_url")})
    if kinds:
        raise ApiError(
            400,
            f"messages[{index}] has content of type {', '.join(kinds)}; this server takes text "
            "and image_url parts",
            param=f"messages[{index}].content",
        )
    parts = []
    for j, part in enumerate(content):
        if part.type == "text":
            parts.append({"type": "text", "text": part.text or ""})
            continue
        url = part.image_url.url if isinstance(part.image_url, ImageUrl) else part.image_url
        parts.append(image_part(url, f"messages[{index}].content[{j}].image_url"))
    return parts_or_text(parts)
