"""A request's generations started: its prompt made ready once (images fetched, settings
checked, the chat template rendered to see how the output begins: `prepare_turn`), then each
generation queued from it (`PreparedTurn.start`): a request's choices (`choices`) pay for that
once, not once each (an image URL was fetched again for every choice).

Owns `prepare_turn`, `PreparedTurn` and `start_turn` (one generation, what most routes start).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from mlxkv.errors import ContextLengthError
from mlxkv.server.errors import ApiError, bad_input_error, context_length_error
from mlxkv.server.images import fetched_images
from mlxkv.server.models.served import request_context
from mlxkv.server.reply.forced_tools import ForcedCall, forced_call_grammar
from mlxkv.server.reply.thinking_split import (
    ThinkingSplitter,
    checked_reasoning,
    output_start,
    renders_whole,
)
from mlxkv.server.reply.tool_calls import BareCallReader, ToolCallSplitter
from mlxkv.server.reply.turn import Turn, reply_keyer
from mlxkv.server.worker import GenerationWorker

logger = logging.getLogger(__name__)


async def start_turn(
    request: Request, messages: Sequence[dict[str, Any]] | str | list[int], **settings: Any
) -> Turn:
    """One generation for an HTTP request (`prepare_turn`'s arguments, and its errors)."""
    return await (await prepare_turn(request, messages, **settings)).start()


@dataclass(frozen=True)
class PreparedTurn:
    """A request's prompt and settings, ready to start its generations (`prepare_turn`)."""

    request: Request
    worker: GenerationWorker
    model_name: str
    prompt: Any  # the messages, images fetched and reasoning checked, or a raw prompt
    sampling: dict[str, Any]
    options: dict[str, Any]  # the rest of `Runner.stream`'s
    with_logprobs: bool
    splitter: ToolCallSplitter | BareCallReader | None  # fresh: copied for each turn
    thinking: ThinkingSplitter | None

    async def start(self, extra: dict[str, Any] | None = None) -> Turn:
        """Queues one generation (kept on `request.state.turn` for the access log), with
        `extra` over its sampling (a choice's seed, its place in the queue: `choices`).

        Raises:
            ApiError: 400 for a request over the window in each API's wording
                (`errors.context_length_error`), 429 when the queue is full.
        """
        splitter, thinking = copy.deepcopy((self.splitter, self.thinking))
        tokenizer = self.worker.runner.tokenizer
        try:
            stream = await self.worker.start(
                self.prompt,
                reply_key=reply_keyer(splitter, thinking, tokenizer),
                **self.options,
                **{**self.sampling, **(extra or {})},
            )
        except ContextLengthError as error:
            raise context_length_error(error, self.request.url.path) from error
        except ValueError as error:
            raise bad_input_error(error, self.model_name) from error
        turn = Turn(stream, splitter, tokenizer, self.with_logprobs, thinking)
        self.request.state.turn = turn
        return turn


async def prepare_turn(
    request: Request,
    messages: Sequence[dict[str, Any]] | str | list[int],
    *,
    tools: list[dict[str, Any]] | None,
    sampling: dict[str, Any],
    top_logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    cache_key: str | None = None,
    max_tokens_asked: bool = True,
    cache_salt: str | None = None,
    forced: ForcedCall | None = None,
    switches: dict[str, Any] | None = None,
    split_thinking: bool = True,
) -> PreparedTurn:
    """Validates a request's prompt and settings. The context never shifts over HTTP (a
    client's history is the client's to cut): a prompt over the window is refused, so is a
    `max_tokens` the client asked for that does not fit after it or is over
    `max_tokens_limit`; a server default that does not fit ends the reply at the window or
    the limit (`max_tokens_asked` False). `cache_salt` keeps the request to its salt's
    entries (vLLM's name). `forced`: a required call's `tool_choice`, kept by a grammar (over
    any structured-output one). `switches`: chat-template variables (`thinking_switch`).
    `split_thinking`: thinking comes as `ReasoningDelta`s where the vocabulary has thinking
    tags and no grammar is kept.

    Raises:
        ApiError: 400 for bad input and a call required with no tools.
    """
    context = await request_context(request)
    worker = _generating_worker(context)
    messages = await fetched_images(messages, context.fetch_images)
    sampling = _within_limit(sampling, context.max_tokens_limit, max_tokens_asked)
    tokenizer = worker.runner.tokenizer
    splitter = _tool_splitter(tokenizer, tools, context.capabilities.tools)
    if forced is not None:
        call = forced_call_grammar(tokenizer, tools or [], forced, messages)
        sampling = {**sampling, "grammar": call.grammar}
        splitter = splitter if call.own_format else BareCallReader()
    split_thinking &= "grammar" not in sampling  # a grammar's form has no thinking tags
    thinking = await _thinking_splitter(worker.runner, messages, switches, splitter, split_thinking)
    try:
        prompt = checked_reasoning(messages, tokenizer)
    except ValueError as error:
        raise bad_input_error(error, context.model_name) from error
    options = {"tools": tools or None, "logprobs": top_logprobs, "truncate": False}
    options |= {"overflow": "refuse" if max_tokens_asked else "stop", "switches": switches}
    options |= {"cache_key": cache_key, "cache_salt": cache_salt}
    if prompt_logprobs is not None:  # the prompt's own, alternatives per token
        options["prompt_logprobs"] = prompt_logprobs
    with_logprobs = top_logprobs is not None
    return PreparedTurn(
        request, worker, context.model_name, prompt, sampling, options, with_logprobs,
        splitter, thinking,
    )  # fmt: skip


def _within_limit(
    sampling: dict[str, Any], limit: int | None, max_tokens_asked: bool
) -> dict[str, Any]:
    """`sampling` with `max_tokens` at most the server's `limit`: a client's own ask over it
    is refused (400), a server default is lowered to it."""
    if limit is None or sampling.get("max_tokens", 0) <= limit:
        return sampling
    if max_tokens_asked:
        raise ApiError(
            400,
            f"max_tokens is {sampling['max_tokens']}, over this server's limit of {limit} "
            "tokens per request (--max-tokens-limit)",
            param="max_tokens",
        )
    return {**sampling, "max_tokens": limit}


def _generating_worker(context: Any) -> GenerationWorker:
    """The context's worker; a 400 naming the model for one that does not generate (an
    encoder embedding model)."""
    worker: GenerationWorker = context.worker
    if not context.capabilities.generates:
        refusal = worker.runner.loaded.model.cannot_generate()
        raise ApiError(400, refusal.for_model(context.model_name), param="model")
    return worker


def _tool_splitter(
    tokenizer: Any, tools: list[dict[str, Any]] | None, shown: bool
) -> ToolCallSplitter | BareCallReader | None:
    """Reads calls in the model's format; None without tools or a format (`shown`: the
    template shows the model its tools)."""
    if tools and tokenizer.has_tool_calling:
        return ToolCallSplitter(
            tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser, tools
        )
    if tools:
        _warn_no_tool_parser(shown)
    return None


async def _thinking_splitter(
    runner: Any,
    prompt: Any,
    switches: dict[str, Any] | None,
    splitter: ToolCallSplitter | BareCallReader | None,
    split: bool,
) -> ThinkingSplitter | None:
    """A splitter at the model's thinking tags, which tool calls (`splitter`) also end, in the
    state the prompt leaves the output (`output_start`); None where the turn is not `split` or
    the vocabulary has no thinking tags. A whole prompt rendered again (a continued message's)
    is rendered off the event loop."""
    tokenizer = runner.tokenizer
    if not split or not tokenizer.has_thinking:
        return None
    start = functools.partial(output_start, runner, prompt, switches)
    begins = await run_in_threadpool(start) if renders_whole(prompt, switches) else start()
    return ThinkingSplitter(
        tokenizer.think_start,
        tokenizer.think_end,
        thinking=begins.thinking,
        after_tag=begins.after_tag,
        exits=(tokenizer.tool_call_start,) if splitter is not None else (),
    )


@functools.cache  # once per process
def _warn_no_tool_parser(shown: bool) -> None:
    seen = (
        "its chat template shows the tools to the model, and any call it writes comes back as text"
        if shown
        else "its chat template leaves the tools out: the model never sees them"
    )
    logger.warning(
        "request has tools but this model has no tool-call format mlx-lm can parse: %s; a "
        "tool_choice that requires a call still returns one (a grammar keeps the reply to it)",
        seen,
    )
