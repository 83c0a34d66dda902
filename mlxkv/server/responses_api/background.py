"""Background responses (`background: true`): made with no request waiting for them, as
OpenAI's background mode. The create call answers at once (`queued`, or the events as they
come when streamed); the response waits in the queue as long as it takes, is read with
`GET /v1/responses/{id}` while it is made, its events again from any one on
(`?stream=true&starting_after=N`, their `sequence_number`), and it is cancelled with
`POST /v1/responses/{id}/cancel`. A client that leaves a background stream ends only its
reading. A response ends as any other: stored (background requires `store`), added to its
conversation, which stays claimed until then, and its model held loaded until then. A
cancelled one keeps what it wrote for reading and nothing else (no turn added, not a previous
response); a stopping server ends those still being made `failed`, in its words.

Kept in memory: every response being made (no more than the server's queues let start), with
its latest events (`MAX_RUN_CHARS`), and the newest finished ones' events, bounded. Each is
also among the stored responses from its start (`history.put_unfinished`, to be read, not
continued, until it ends as a turn): a server with a state directory that is killed while it
is made reads it back `failed`, and one that ended cancelled or failed is read back so.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from fastapi import FastAPI, Request

from mlxkv.server.errors import ApiError
from mlxkv.server.middleware import SHUTTING_DOWN
from mlxkv.server.models.served import outliving_hold
from mlxkv.server.reply.turn import Turn
from mlxkv.server.responses_api.conversations import TurnClaim
from mlxkv.server.responses_api.history import ResponseHistory
from mlxkv.server.state import BoundedMap, guarded_events, json_chars, sse

logger = logging.getLogger(__name__)

# Finished background responses whose events are kept to be read again.
MAX_FINISHED = 64
MAX_FINISHED_CHARS = 64 * 2**20
# The most characters of events one response keeps to be read again: past it, its earliest
# go (a token's events take about 300 characters, 8,000 with 20 `top_logprobs`).
MAX_RUN_CHARS = 32 * 2**20
# The longest a stopping server waits for its background responses to end once stopped.
CLOSE_WAIT_S = 10.0
_RUNNING = ("queued", "in_progress")


class Made(Protocol):
    """The response a run makes, as the Responses routes build it."""

    id: str
    latest: dict[str, Any]  # the response object its last event carried
    written: Callable[[], list[dict[str, Any]]]  # its output items so far

    def cut_short(self) -> list[dict[str, Any]]: ...

    def body(self, output: list[dict[str, Any]], completion: Any, status: str = "") -> dict: ...

    def failed_event(self, error: ApiError) -> str: ...


class BackgroundRun:
    """One background response: its events as they come (the one numbered n is the one whose
    `sequence_number` is n; the earliest go past `MAX_RUN_CHARS`), the response object as it
    stands, and the task that makes it. Once ended it holds only its events and the object."""

    def __init__(self, response: Made, turn: Turn, salt: str | None, max_chars: int):
        self.salt = salt  # the `cache_salt` it was made with: another tenant's requests miss it
        self.lines: collections.deque[str] = collections.deque()
        self.first = 0  # the number of the earliest event held
        self.chars = 0  # of the events held
        self.ended = False
        self.task: asyncio.Task[None] | None = None
        self._max_chars = max_chars
        self._response: Made | None = response
        self._final: dict[str, Any] = {}
        self._turn = turn
        self._stopped_by: ApiError | None = None  # a stopping server's words
        self._more = asyncio.Event()  # set, and replaced, at each event and at the end

    @property
    def latest(self) -> dict[str, Any]:
        """The response object as it stands: while it is made, with what it wrote so far."""
        if self._response is None:
            return self._final
        latest = self._response.latest
        if latest["status"] != "in_progress":
            return latest
        return {**latest, "output": self._response.written()}

    @property
    def status(self) -> str:
        return self.latest["status"]

    def start(
        self,
        events: AsyncIterator[str],
        releases: Sequence[Callable[[], None]],
        ended: Callable[[BackgroundRun], None],
    ) -> None:
        """Makes the response from `events` (its stream's) on a task of its own; when it ends,
        however it ends, calls `releases` (its conversation's claim, its model's hold) and
        tells `ended`."""
        self.task = asyncio.create_task(self._make(events, releases, ended))

    async def _make(self, events, releases, ended) -> None:
        response = self._response
        assert response is not None
        try:
            async for line in guarded_events(events, self._turn, response.failed_event):
                self._add(line)
            await self._turn.finished()  # its generation's very end, before its model may go
        finally:  # the event loop's own end included
            self._turn.cancel()
            for release in releases:
                release()
            stopped = self._stopped_by is not None and self.status in (*_RUNNING, "cancelled")
            if stopped:  # by a stopping server (its wait run out included): failed, it says
                self._add(response.failed_event(self._stopped_by))
            elif self.status in _RUNNING:  # cancelled before it ended
                response.latest = response.body(response.cut_short(), None, "cancelled")
            self._final, self._response, self._turn = response.latest, None, None
            self.ended = True
            self._wake()
            ended(self)

    def _add(self, line: str) -> None:
        self.lines.append(line)
        self.chars += len(line)
        while self.chars > self._max_chars and len(self.lines) > 1:
            self.chars -= len(self.lines.popleft())
            self.first += 1
        self._wake()

    def _wake(self) -> None:
        more, self._more = self._more, asyncio.Event()
        more.set()

    def check_after(self, after: int | None) -> None:
        """Raises:
        ApiError: 400 when the events after `after` (None: all) are no longer all held."""
        if (-1 if after is None else after) + 1 < self.first:
            param = "stream" if after is None else "starting_after"
            message = f"{param}: the events before {self.first} are no longer kept"
            raise ApiError(400, message, param=param)

    async def read(self, after: int = -1) -> AsyncIterator[str]:
        """The events after the one numbered `after`, those to come included; a reader so
        far behind that its next event went meanwhile (a burst of large events: with 20
        `top_logprobs` each closing event holds every token's) ends with an `error` event
        saying so, instead of a stream cut short."""
        number = max(after + 1, 0)
        while True:
            if number < self.first:  # went while this reader waited, or was paused mid-send
                yield _dropped(number, self.first, self._max_chars)
                return
            if number - self.first < len(self.lines):
                yield self.lines[number - self.first]
                number += 1
            elif self.ended:
                return
            else:
                await self._more.wait()

    def stop(self, error: ApiError | None = None) -> None:
        """Ends the generation: the response ends `cancelled`, what it wrote kept, or with
        `error` `failed` (one that had ended already stays as it ended)."""
        self._stopped_by = self._stopped_by or error  # a cancel meanwhile does not undo a stop
        if self._turn is not None:
            self._turn.cancel()

    async def cancel(self) -> None:
        """`stop`, then waits for the response to end."""
        self.stop()
        if self.task is not None:
            await asyncio.shield(self.task)  # a canceller that leaves does not stop the end


class BackgroundResponses:
    """The background responses being made, by id (no more than the server's queues let
    start), and the newest finished ones."""

    def __init__(
        self,
        history: ResponseHistory,
        max_finished: int = MAX_FINISHED,
        max_chars: int = MAX_FINISHED_CHARS,
        max_run_chars: int = MAX_RUN_CHARS,
    ):
        self._history = history  # where one that ends otherwise than as a turn is kept too
        self._running: dict[str, BackgroundRun] = {}
        self._finished: BoundedMap[BackgroundRun] = BoundedMap(max_finished, max_chars)
        self._max_run_chars = max_run_chars

    def start(
        self,
        request: Request,
        response: Made,
        turn: Turn,
        events: AsyncIterator[str],
        claim: TurnClaim,
        salt: str | None,
        input_items: list[dict[str, Any]],
    ) -> BackgroundRun:
        """Makes `response` from `events` (`BackgroundRun.start`), held here while it is made
        and among the finished ones after; the request's model stays loaded until then, and
        its conversation (`claim`, detached from the request) claimed. It is among the stored
        responses from now (with its `input_items`), to be read: kept as it ends, if not as
        a turn, and a server killed meanwhile reads it back failed."""
        turn.keep_queued()  # nobody waits for it
        run = BackgroundRun(response, turn, salt, self._max_run_chars)
        self._running[response.id] = run
        self._history.put_unfinished(response.latest, input_items, salt)
        runner = request.state.mlxkv.worker.runner
        run.start(events, (claim.release, outliving_hold(request)), self._ended(runner))
        return run

    def _ended(self, runner: Any) -> Callable[[BackgroundRun], None]:
        def ended(run: BackgroundRun) -> None:
            response_id = run.latest["id"]
            del self._running[response_id]
            self._finished.put(response_id, run, run.chars + json_chars(run.latest))
            if run.status in ("cancelled", "failed"):  # a turn is stored as it ends
                self._history.put_unfinished(run.latest, None, run.salt)
            usage = run.latest.get("usage")
            tokens = "" if usage is None else _token_counts(usage)
            # the memory line, as the access line says it after a generation
            logger.info(
                "responses: background %s %s%s | %s",
                response_id,
                run.status,
                tokens,
                runner.memory_line,
            )

        return ended

    def find(self, response_id: str, salt: str | None) -> BackgroundRun | None:
        """The background response being made, or finished and kept, for `salt`."""
        found = self._running.get(response_id) or self._finished.get(response_id)
        return None if found is None or found.salt != salt else found

    def forget(self, response_id: str) -> None:
        self._finished.pop(response_id)

    async def close(self) -> None:
        """Ends every response still being made, `failed` with the server's stopping words
        (as a generation a stop signal cuts), and waits for them to end (a stuck one no longer
        than `CLOSE_WAIT_S`)."""
        runs = list(self._running.values())
        for run in runs:
            run.stop(ApiError(503, SHUTTING_DOWN))
        tasks = [run.task for run in runs if run.task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)


def _token_counts(usage: dict[str, Any]) -> str:
    cached = usage["input_tokens_details"]["cached_tokens"]
    return f" prompt={usage['input_tokens']} cached={cached} generated={usage['output_tokens']}"


def _dropped(number: int, first: int, kept_chars: int) -> str:
    """OpenAI's stream `error` event, for a reader whose next events are no longer kept."""
    message = (
        f"the events {number} to {first - 1} of this response are no longer kept (each "
        f"response keeps its latest {kept_chars:,} characters of events): read the response "
        f"with GET, or its events again after {first - 1}"
    )
    event = {"type": "error", "code": "events_dropped", "message": message, "param": None}
    return sse({**event, "sequence_number": number}, "error")


def check_background(background: bool, store: bool) -> None:
    """Raises:
    ApiError: 400 for a background response that would not be stored (nothing could read
        it)."""
    if background and not store:
        message = "background responses must be stored: send store true (or leave it out)"
        raise ApiError(400, message, param="background")


def keep_background(app: FastAPI) -> None:
    """Gives `app` its background responses (none: a new server makes none), kept with its
    stored responses (`history.keep_responses` first)."""
    app.state.background = BackgroundResponses(app.state.responses)


def background_responses(served: Request | FastAPI) -> BackgroundResponses:
    """The background responses of an app, or of the app serving a request
    (`keep_background`); its stop `close`s them."""
    app = served.app if isinstance(served, Request) else served
    return app.state.background
