"""One generation as every API sees it: thinking and answer text deltas with their
log-probabilities, tool calls, and the finished Completion. Shared by the routers, which
only format.

Owns: `Turn` (a generation's events; started by `start`), `reply_keyer` (what the Runner
remembers its reply by) and `collect` (a reply's events, for a response that is not
streamed). The text goes through one pipeline: detokenized text -> thinking split
(`thinking_split`) -> tool-call parse of the answer part (`tool_calls`). Does not own the
wire formats.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from mlxkv.decoding.picker import TokenLogprob
from mlxkv.decoding.prefill.scoring import PromptLogprobs
from mlxkv.runner.results import Completion, GenerationChunk, PromptUsage
from mlxkv.runner.text.replies import ReplyKey, call_reply_key
from mlxkv.server.errors import ApiError
from mlxkv.server.reply.thinking_split import (
    ThinkingSplitter,
    Thought,
)
from mlxkv.server.reply.tool_calls import BareCallReader, Piece, ToolCall, ToolCallSplitter
from mlxkv.server.worker import GenerationStream

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenInfo:
    """A generated token's text and log-probability, with the most likely alternatives."""

    text: str
    logprob: float | None  # None: a prompt's first token (nothing before it)
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
        # the prompt's own log-probabilities where asked for (`prompt_logprobs`), as `prompt`
        self.prompt_logprobs: list[TokenInfo] | None = None
        # the EOS that ended the reply, with logprobs: never text, yet a generated token
        self.end_logprob: TokenInfo | None = None
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
            await self._note_ends(chunk)
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

    async def _note_ends(self, chunk: GenerationChunk) -> None:
        """Keeps the prompt's own log-probabilities and the ending EOS's, where they come; the
        prompt's decoded off the event loop (a token and its alternatives each: 0.5 s for
        8,000 tokens, every other stream stalled meanwhile, review25)."""
        if chunk.prompt_logprobs is not None and self.prompt_logprobs is None:
            infos = await run_in_threadpool(self._prompt_infos, chunk.prompt_logprobs)
            self.prompt_logprobs = infos
        if self._with_logprobs and chunk.end_logprob is not None:
            self.end_logprob = self._token_info(chunk.end_token, chunk.end_logprob)

    def _prompt_infos(self, scored: PromptLogprobs) -> list[TokenInfo]:
        """Each prompt token's `TokenInfo`, the first's without log-probabilities (None, no
        alternatives: nothing comes before it)."""
        first = TokenInfo(self._tokenizer.decode(scored.tokens[:1]), None, [])
        pairs = zip(scored.tokens[1:], scored.logprobs, strict=True)
        return [first, *(self._token_info(token, logprob) for token, logprob in pairs)]

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
