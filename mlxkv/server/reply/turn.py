"""One generation as every API sees it: thinking and answer text deltas with their
log-probabilities, tool calls, and the finished Completion. Shared by the routers, which
only format.

Owns: `start_turn` (queue a generation with the request's tools and settings), `Turn` (its
events) and `reply_keyer` (what the Runner remembers its reply by). The text goes through one
pipeline: detokenized text -> thinking split (`thinking_split`) -> tool-call parse of the
answer part (`tool_calls`). Does not own the wire formats.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from mlxkv.decoding.picker import TokenLogprob
from mlxkv.errors import ContextLengthError
from mlxkv.runner.results import Completion, PromptUsage
from mlxkv.runner.text.replies import ReplyKey, call_reply_key
from mlxkv.server.errors import ApiError, bad_input_error, context_length_error
from mlxkv.server.images import fetched_images
from mlxkv.server.models.served import request_context
from mlxkv.server.reply.forced_tools import ForcedCall, forced_call_grammar
from mlxkv.server.reply.thinking_split import (
    ThinkingSplitter,
    Thought,
    checked_reasoning,
    output_start,
    renders_whole,
)
from mlxkv.server.reply.tool_calls import BareCallReader, Piece, ToolCall, ToolCallSplitter
from mlxkv.server.worker import GenerationStream, GenerationWorker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenInfo:
    """A generated token's text and log-probability, with the most likely alternatives."""

    text: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class TextDelta:
    """Answer text."""

    text: str
    logprobs: list[TokenInfo] = field(default_factory=list)


@dataclass
class ReasoningDelta:
    """Thinking text (never part of a `TextDelta`)."""

    text: str
    logprobs: list[TokenInfo] = field(default_factory=list)


Event = ReasoningDelta | TextDelta | ToolCall | Completion
# In place of an event: the reply is late, or goes on with nothing to show yet (a tool call
# being written comes out whole), and a client's idle watchdog wants an event (`early_events`).
WAITING = object()


class Turn:
    """The events of one generation: `ReasoningDelta`s, `TextDelta`s and `ToolCall`s in
    order, then the `Completion`. Leaving the iteration early cancels the generation. The
    Runner remembers the reply (before its Completion is handed on) by what the client sends
    back (`reply_keyer`), so the next turn's prompt takes its ids as the cache holds them.
    """

    def __init__(
        self,
        stream: GenerationStream,
        splitter: ToolCallSplitter | BareCallReader | None,
        tokenizer: Any,
        with_logprobs: bool,
        thinking: ThinkingSplitter | None = None,
    ):
        self._stream = stream
        self._splitter = splitter
        self._thinking = thinking
        self._tokenizer = tokenizer
        self._with_logprobs = with_logprobs
        self.prompt: PromptUsage | None = None  # known from the first event on
        # Tokens of the model's thinking (OpenAI's `reasoning_tokens`): those with a thought
        # open before or after them, its tags included.
        self.reasoning_tokens = 0
        self.generated_tokens = 0  # so far: what a reply that fails before its end used

    def cancel(self) -> None:
        self._stream.cancel()

    def keep_queued(self) -> None:
        """Nobody waits for this reply (a background response's): it waits for its turn as
        long as it takes (`GenerationStream.keep_queued`)."""
        self._stream.keep_queued()

    @property
    def may_think(self) -> bool:
        """Whether thinking can come before the answer (the vocabulary has thinking tags and
        no grammar keeps them out): a stream that opens a block early opens a thinking one."""
        return self._thinking is not None

    @property
    def matched(self) -> asyncio.Future[PromptUsage | None]:
        """The prompt's usage once the cache is matched, before the prefill (what the first
        event's `prompt` says: known before the prompt is processed); None where the
        generation ended before it."""
        return self._stream.matched

    async def finished(self) -> Completion | None:
        """The Completion once the generation has ended, even if nobody read it (a client
        that left); None if it failed."""
        return await self._stream.finished

    async def events(self, waiting_after_s: float | None = None) -> AsyncIterator[Event]:
        """The events; with `waiting_after_s`, also `WAITING` each time a token comes that long
        after the last thing yielded and shows nothing yet (a tool call's text is held until
        the call is whole: an agent's file write can take minutes). Costs a clock read a
        token."""
        pending: list[TokenInfo] = []
        yielded_s = time.monotonic()
        async for chunk in self._stream:
            self.prompt = self.prompt or chunk.prompt
            self.generated_tokens += chunk.token is not None
            if self._with_logprobs and chunk.logprob is not None:
                pending.append(self._token_info(chunk.token, chunk.logprob))
            was_thinking = self._thinking_now()
            pieces = self._pieces(chunk.text, ended=chunk.completion is not None)
            if chunk.token is not None and (was_thinking or self._thinking_now()):
                self.reasoning_tokens += 1
            now_s = time.monotonic()
            late = waiting_after_s is not None and now_s - yielded_s >= waiting_after_s
            if pieces:
                yielded_s = now_s
            elif late and chunk.completion is None:  # the last chunk's events come now
                yielded_s = now_s
                yield WAITING
            for piece in pieces:
                if isinstance(piece, ToolCall):
                    yield piece
                elif isinstance(piece, Thought):
                    yield ReasoningDelta(piece.text, pending)
                    pending = []
                else:
                    yield TextDelta(piece, pending)
                    pending = []
            if chunk.completion is not None:
                if pending:
                    yield TextDelta("", pending)
                yield chunk.completion

    def _thinking_now(self) -> bool:
        return self._thinking is not None and self._thinking.thinking

    def _pieces(self, text: str, ended: bool) -> list[Piece | Thought]:
        return _split(text, ended, self._splitter, self._thinking)

    def _token_info(self, token: int, logprob: TokenLogprob) -> TokenInfo:
        decode = self._tokenizer.decode
        top = [(decode([alternative]), value) for alternative, value in logprob.top]
        return TokenInfo(decode([token]), logprob.logprob, top)


def _split(
    text: str,
    ended: bool,
    splitter: ToolCallSplitter | BareCallReader | None,
    thinking: ThinkingSplitter | None,
) -> list[Piece | Thought]:
    """Generated text through the pipeline: thinking split, then tool calls parsed from the
    answer part; `ended`: the generation's last text (all held text comes out)."""
    parts: list[Thought | str] = [text] if text else []
    if thinking is not None:
        parts = thinking.push(text) + (thinking.finish() if ended else [])
    pieces: list[Piece | Thought] = []
    for part in parts:
        if isinstance(part, Thought):
            # answer text held back for a possible marker is older: it goes first
            pieces += splitter.finish() if splitter else []
            pieces.append(part)
        else:
            pieces += splitter.push(part) if splitter else [part]
    if ended and splitter is not None:
        pieces += splitter.finish()
    return pieces


def reply_keyer(
    splitter: ToolCallSplitter | BareCallReader | None,
    thinking: ThinkingSplitter | None,
    tokenizer: Any,
) -> ReplyKey | None:
    """What a turn's reply is known by when sent back (`Runner.stream`'s `reply_key`, run on
    the engine thread at its end): one with tool calls, no thought and not cut by max_tokens,
    by `_call_reply_key` (its text and calls as the client sends them back, not the text the
    model wrote); any other by its text. Reads the reply with copies of the turn's `splitter`
    and `thinking` (made before any text is pushed); one holding `tokenizer`'s thinking tags
    had a thought, if an empty one. None: no calls to read."""
    if splitter is None:
        return None
    splitter, thinking = copy.deepcopy((splitter, thinking))
    splitter.warns = False  # the turn's own reading said it
    began_thinking = thinking is not None and thinking.thinking
    thinking_tags = (tokenizer.think_start, tokenizer.think_end) if thinking is not None else ()

    def key(completion: Completion) -> str | None:
        # not one cut by max_tokens: its last call may be cut before its end marker (parsed
        # all the same), which the client sends back as a whole call
        text = completion.text
        if completion.finish_reason != "stop" or began_thinking:
            return None
        if any(tag in text for tag in thinking_tags):
            return None
        pieces = _split(text, True, splitter, thinking)
        calls = [piece for piece in pieces if isinstance(piece, ToolCall)]
        if not calls or any(isinstance(piece, Thought) for piece in pieces):
            return None
        return _call_reply_key("".join(p for p in pieces if isinstance(p, str)), calls)

    return key


def _call_reply_key(answer: str, calls: list[ToolCall]) -> str | None:
    """What a reply of `answer` and `calls` is known by when sent back
    (`replies.call_reply_key`): with the call ids the model wrote (in its token ids, so the
    client's must be those), or without ids where it wrote none (ids made here are not in its
    token ids, and Ollama's client sends none back). None where the client got another id
    than one the model wrote (its template would refuse it): those ids would show an id that
    no tool result answers."""
    named = [(call.name, call.arguments) for call in calls]
    written = [call.written_id for call in calls]
    if all(written_id is None for written_id in written):
        return call_reply_key(answer, named)
    return call_reply_key(answer, named, written) if written == [c.id for c in calls] else None


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


async def start_turn(
    request: Request,
    messages: Sequence[dict[str, Any]] | str | list[int],
    *,
    tools: list[dict[str, Any]] | None,
    sampling: dict[str, Any],
    top_logprobs: int | None = None,
    cache_key: str | None = None,
    max_tokens_asked: bool = True,
    cache_salt: str | None = None,
    forced: ForcedCall | None = None,
    switches: dict[str, Any] | None = None,
    split_thinking: bool = True,
) -> Turn:
    """Validates and queues one generation for an HTTP request (kept on `request.state.turn`
    for the access log). The context never shifts over HTTP (a client's history is the
    client's to cut): a prompt over the window is refused, so is a `max_tokens` the client
    asked for that does not fit after it or is over `max_tokens_limit`; a server default that
    does not fit ends the reply at the window or the limit (`max_tokens_asked` False).
    `cache_salt` keeps the request to its salt's entries (vLLM's name). `forced`: a required
    call's `tool_choice`, kept by a grammar (over any structured-output one). `switches`:
    chat-template variables (`thinking_switch`). `split_thinking`: thinking comes as
    `ReasoningDelta`s where the vocabulary has thinking tags and no grammar is kept.

    Raises:
        ApiError: 400 for bad input, a call required with no tools, and a request over the
            window in each API's wording (`errors.context_length_error`).
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
        stream = await worker.start(
            checked_reasoning(messages, tokenizer),
            tools=tools or None,
            logprobs=top_logprobs,
            truncate=False,
            overflow="refuse" if max_tokens_asked else "stop",
            cache_key=cache_key,
            cache_salt=cache_salt,
            switches=switches,
            reply_key=reply_keyer(splitter, thinking, tokenizer),
            **sampling,
        )
    except ContextLengthError as error:
        raise context_length_error(error, request.url.path) from error
    except ValueError as error:
        raise bad_input_error(error, context.model_name) from error
    turn = Turn(stream, splitter, tokenizer, top_logprobs is not None, thinking)
    request.state.turn = turn
    return turn


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


async def collect(turn: Turn, request: Request) -> tuple[list[Event], Completion]:
    """All of a turn's events, for a response that is not streamed; a client that
    disconnects meanwhile cancels the generation.

    Raises:
        ApiError: 499 (nginx's "client closed request") when it left while the generation
            waited for its turn: there is no reply, and the request ends (it waited forever).
    """
    [collected] = await collect_each([turn], request)
    return collected


async def collect_each(
    turns: Sequence[Turn], request: Request
) -> list[tuple[list[Event], Completion]]:
    """`collect` for each of several turns at once (a request's choices): one that fails, or
    a client that leaves, cancels them all."""
    watcher = asyncio.create_task(_cancel_on_disconnect(turns, request))
    try:
        collected = await asyncio.gather(*(_events(turn) for turn in turns))
    except BaseException:
        for turn in turns:
            turn.cancel()
        raise
    finally:
        watcher.cancel()
    if not all(events and isinstance(events[-1], Completion) for events in collected):
        raise ApiError(499, "the client closed the request before its generation started")
    return [(events[:-1], events[-1]) for events in collected]


async def _events(turn: Turn) -> list[Event]:
    return [event async for event in turn.events()]


async def _cancel_on_disconnect(turns: Sequence[Turn], request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for turn in turns:
                turn.cancel()
            return


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
