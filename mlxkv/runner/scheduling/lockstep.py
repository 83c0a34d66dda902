"""Every rank's cache in step when one model is sharded over several processes (`mlx.launch`).

Owns `Lockstep`: rank 0 decides and the other ranks replay; and `StepWatchdog`, the bound on
one step of theirs. Does not own finding the process group or sharding the model
(`mlxkv.models.sharding`). Does not own any cache policy: every rank runs the same Runner code
on the same inputs, so prefix matching, trims, checkpoint restores, context cuts and shifts,
and eviction come out the same on every rank.

How the ranks stay in step:
  - rank 0 (the leader) broadcasts each operation before running it: a request (its fitted
    prompt tokens, sampling settings with a seed drawn by the leader when none was given, and
    the other options), a reset, entries dropped by their cache key, or the end; the others
    (followers) replay it in `follow`;
  - the settings that decide the cache's behaviour (context window, entries, byte budget) are
    the leader's, broadcast when the Runner is built;
  - a cancel is decided together: at every point where a request checks its cancel flag, all
    ranks sum rank 0's flag (one tiny all_sum), so every rank stops at the same token;
  - a leader whose caller stops reading a stream cancels it and runs it to that agreed stop.
A rank that stops answering fails every rank still waiting for it within MLXKV_RANK_TIMEOUT_S:
this module's own collectives are bounded; the sharded layers' collectives inside a forward
pass (a wait MLX cannot bound) are watched step by step (`StepWatchdog`: a prefill chunk or a
decode step, not a whole request), and a step that outlives the bound abandons the engine
thread stuck in it.
Decisions that read clocks (the disk tier weighing loads against prefill speed) are not
taken: the disk tier is refused when sharded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import mlx.core as mx

from mlxkv.config import RunnerConfig, format_bytes, rank_timeout_s
from mlxkv.decoding.sampling import SamplingParams
from mlxkv.errors import NotSupportedError, RanksOutOfStepError
from mlxkv.runner.prompt_cache.report import MemoryReport
from mlxkv.runner.request import Request
from mlxkv.runner.results import Completion, GenerationChunk
from mlxkv.runner.scheduling.engine import EngineThread
from mlxkv.runner.text.replies import ReplyStart

logger = logging.getLogger(__name__)


class Lockstep:
    """Rank 0 leads, the other ranks follow (see the module docstring).

    Args:
        group: the process group (size > 1).
        engine: the Runner's engine thread, which runs the forward passes (abandoned when
            one of their steps outlives the timeout).
    """

    def __init__(self, group: mx.distributed.Group, engine: EngineThread):
        self._timeout_s = rank_timeout_s()  # checked before anything starts
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        # Collectives run one at a time on a thread of their own, so a wait for a rank that
        # froze or died is bounded (MLX's own wait cannot be interrupted).
        self._collectives = EngineThread(f"mlxkv-collectives-{self.rank}")
        self._engine = engine
        self._watchdog = StepWatchdog(
            self._timeout_s, self._step_expired, f"mlxkv-watchdog-{self.rank}"
        )
        self.failure: str | None = None  # why the ranks are out of step, once they are
        self.failed = threading.Event()  # set with `failure`
        self._failing = threading.Lock()  # the engine's and the watchdog's threads may both

    sharded = True

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def _sum(self, values: list[int], dtype: mx.Dtype, *, bounded: bool = True) -> list[int]:
        """The element-wise sum of `values` over the ranks.

        Raises:
            RanksOutOfStepError: a `bounded` wait ran past the timeout, or the link to another
                rank broke, now or before.
        """
        if self.failure is not None:
            raise RanksOutOfStepError(self.failure)

        def collective() -> list[int]:
            summed = mx.distributed.all_sum(
                mx.array(values, dtype=dtype), group=self.group, stream=mx.cpu
            )
            return summed.tolist()

        # The model's own collectives (sharded layers) run on the engine thread's stream: they
        # must all be done before this one starts on another thread, or the two interleave on
        # the wire. (A rank that freezes inside a forward pass is bounded by the watchdog.)
        mx.synchronize()
        stepping = self._watchdog.pause()  # the step ends here: this wait has its own bound
        try:
            summed = self._collectives.call(
                collective, timeout_s=self._timeout_s if bounded else None
            )
        except TimeoutError:
            error = RanksOutOfStepError(
                self._record(
                    f"the other ranks did not answer within {self._timeout_s:g} s (one froze "
                    "or died); the sharded model cannot serve any more: restart every rank "
                    "(MLXKV_RANK_TIMEOUT_S sets the wait)"
                )
            )
            self._collectives.abandon(error)
            raise error from None
        except RuntimeError as error:  # MLX's ring: "connection to a peer was lost", or any
            # other failure of the collective: either way the ranks are out of step for good
            self._fail(
                f"a collective with the other ranks failed ({error}; a rank died or the link "
                "broke); the sharded model cannot serve any more: restart every rank"
            )
        if stepping:
            self._watchdog.begin()
        return summed

    def _fail(self, why: str) -> NoReturn:
        """Every later request fails at once: the ranks are out of step for good."""
        raise RanksOutOfStepError(self._record(why)) from None

    def _record(self, why: str) -> str:
        """Keeps (and logs) the first reason the ranks fell out of step; returns the kept
        one (a step's watchdog and a collective's timeout may both see one freeze)."""
        with self._failing:
            if self.failure is None:
                self.failure = f"rank {self.rank}: {why}"
                logger.error("%s", self.failure)
                self.failed.set()
        return self.failure

    def _step_expired(self) -> None:
        """The watchdog's thread: a step outlived the timeout, its engine thread stuck in a
        forward pass's collective for good; every reader and later request fails now."""
        failure = self._record(
            f"one step of the sharded model (a prefill chunk or a decode step) ran past "
            f"MLXKV_RANK_TIMEOUT_S={self._timeout_s:g} s: another rank froze or died inside "
            "the forward pass; the sharded model cannot serve any more: restart every rank "
            "(or raise MLXKV_RANK_TIMEOUT_S if one step is that slow)"
        )
        self._engine.abandon(RanksOutOfStepError(failure))

    def broadcast(self, message: dict[str, Any] | None, *, bounded: bool = True) -> dict[str, Any]:
        """Rank 0's `message` (JSON-able), on every rank; the others pass None. A follower
        waiting for the leader's next operation passes `bounded=False` (idle is normal)."""
        payload = json.dumps(message).encode() if self.leads else b""
        (size,) = self._sum([len(payload)], mx.int32, bounded=bounded)
        data = list(payload) if self.leads else [0] * size
        return json.loads(bytes(self._sum(data, mx.uint8)))

    def agree(self, flag: bool) -> bool:
        """Rank 0's `flag`, on every rank."""
        mine = 1 if flag and self.leads else 0
        return bool(self._sum([mine], mx.int32)[0])

    def total(self, value: int) -> int:
        """The sum of `value` over the ranks."""
        return int(self._sum([value], mx.int64)[0])

    def check_can_lead(self) -> None:
        """Raises at once where a request could only hang: on a follower (the leader never
        sends it), or once the ranks are out of step.

        Raises:
            NotSupportedError: this rank is not 0.
            RanksOutOfStepError: a wait for the other ranks ran past its timeout.
        """
        if not self.leads:
            raise NotSupportedError(
                f"this is rank {self.rank} of a model sharded over {self.size} processes: only "
                "rank 0 calls stream()/generate(); ranks other than 0 call runner.follow(), "
                "which runs rank 0's requests in step with it until rank 0 closes its Runner"
            )
        if self.failure is not None:
            raise RanksOutOfStepError(self.failure)

    def prepare(self, request: Request) -> Request:
        """Leader: the request as every rank will run it: a cancel flag that every rank reads
        alike (`AgreedCancel`), and a seed drawn here when it samples without one (every
        rank must draw alike; drawn before the request runs, which seeds with it)."""
        params = request.params
        if params.seed is None and params.temperature > 0:
            params = dataclasses.replace(params, seed=int.from_bytes(os.urandom(7), "little"))
        cancelled = AgreedCancel(request.cancelled, self)
        return dataclasses.replace(request, params=params, cancelled=cancelled)

    def run(
        self, request: Request, run: Callable[[Request], Iterator[GenerationChunk]]
    ) -> Iterator[GenerationChunk]:
        """Runs a request in step: the leader announces it first and, if its caller stops
        reading, runs it to the agreed cancel (`drain`); followers just run it. Each of its
        steps is watched, the time its reader takes between two chunks left out."""
        self._watchdog.begin()
        try:
            if self.leads:
                self.announce_request(request)
            yield from drain(run(request), request.cancelled, self._watchdog)
        finally:
            self._watchdog.pause()

    def leaders_settings(self, config: RunnerConfig) -> RunnerConfig:
        """`config` with rank 0's context window (tokens) and cache settings, on every rank:
        they decide cuts, shifts and evictions, which must come out alike (machines may differ
        in memory, and so in their defaults).

        Raises:
            NotSupportedError: a disk tier is set (its choices depend on measured speeds).
        """
        if config.cache_dir is not None:
            raise NotSupportedError(
                "the disk tier (cache_dir) is not supported when the model is sharded over "
                "several processes; leave cache_dir unset (mlxkv serve: --no-cache-dir)"
            )
        shared = self.broadcast(  # unbounded: the ranks may finish loading far apart
            bounded=False,
            message={
                "max_context": config.max_context,
                "cache_entries": config.cache_entries,
                "cache_bytes": config.cache_bytes,
            },
        )
        return config.replace(**shared)

    def ranks_line(self, report: MemoryReport) -> str:
        """What the memory log line adds when sharded: this rank, and the sum over ranks."""
        held = self.total(report.allocated_bytes)
        return f" (rank {self.rank} of {self.size}; all ranks: {format_bytes(held)} allocated)"

    def announce_request(self, request: Request) -> None:
        """Leader: sends the request (`prepare`d) to the followers."""
        start = request.reply_start
        self.broadcast(
            {
                "op": "request",
                "tokens": request.tokens,
                "keep": request.keep,
                "header_tokens": request.header_tokens,
                "params": dataclasses.asdict(request.params),
                "top_logprobs": request.top_logprobs,
                "prompt_logprobs": request.prompt_logprobs,
                "cache_key": request.cache_key,
                "drops_before": request.drops_before,
                "evict_first": request.evict_first,
                "speculative": request.speculative,
                "grammar": request.grammar,
                "cache_salt": request.cache_salt,
                # how its text begins: a stop string matched on one rank's text alone ends
                # that rank's request, and the others wait for it in their next collective
                "continues_text": request.continues_text,
                "reply_start": start and dataclasses.asdict(start),
            }
        )

    def announce(self, op: str, **fields: Any) -> None:
        """Leader: sends an operation other than a request ("reset", "drop" with its
        `cache_key`, "stop")."""
        self.broadcast({"op": op, **fields})

    def follow(
        self,
        stream: Callable[[Request], Iterator[GenerationChunk]],
        reset: Callable[[], None],
        drop: Callable[[str], int],
    ) -> Iterator[Completion]:
        """Follower: runs the leader's operations until "stop", yielding each request's
        Completion (`stream`, `reset` and `drop` are the Runner's)."""
        while (received := self.receive())[0] != "stop":
            op, payload = received
            if op == "reset":
                reset()
            elif op == "drop":
                drop(payload["cache_key"])
            else:
                yield list(stream(payload))[-1].completion

    def receive(self) -> tuple[str, Any]:
        """Follower: the leader's next operation, with its request for "request" and the
        message itself for any other."""
        message = self.broadcast(None, bounded=False)
        if message["op"] != "request":
            return message["op"], message
        params = message["params"]
        request = Request(
            tokens=message["tokens"],
            keep=message["keep"],
            header_tokens=message["header_tokens"],
            params=SamplingParams(**{**params, "stop": tuple(params["stop"])}),
            progress=None,
            cancelled=AgreedCancel(threading.Event(), self),
            top_logprobs=message["top_logprobs"],
            prompt_logprobs=message["prompt_logprobs"],
            cache_key=message["cache_key"],
            drops_before=message["drops_before"],
            evict_first=message["evict_first"],
            speculative=message["speculative"],
            grammar=message["grammar"],
            cache_salt=message["cache_salt"],
            continues_text=message["continues_text"],
            reply_start=message["reply_start"] and ReplyStart(**message["reply_start"]),
        )
        return "request", request


class Solo:
    """The lockstep of a Runner that is not sharded: one process, which leads and never waits
    for another. It stands where `Lockstep` stands, so the request path has no second branch
    for the unsharded case."""

    rank = 0
    size = 1
    leads = True
    sharded = False
    failure: str | None = None
    failed = threading.Event()  # never set: one process cannot fall out of step

    def check_can_lead(self) -> None:
        pass

    def prepare(self, request: Request) -> Request:
        return request

    def run(
        self, request: Request, run: Callable[[Request], Iterator[GenerationChunk]]
    ) -> Iterator[GenerationChunk]:
        return run(request)

    def leaders_settings(self, config: RunnerConfig) -> RunnerConfig:
        return config

    def ranks_line(self, report: MemoryReport) -> str:
        return ""

    def announce(self, op: str, **fields: Any) -> None:
        pass


class StepWatchdog:
    """Calls `expired()` (on its own thread, once) when a step has run `timeout_s` seconds.

    Why a thread: a rank that freezes while the others are inside a forward pass leaves them
    waiting in the sharded layers' own collectives (MLX's ring all_reduce, reached from
    `mx.synchronize` or `.item()` on the engine thread); MLX's wait cannot be interrupted or
    given a deadline, so the thread that waits cannot time itself out. A step is the work
    between two meetings of the ranks (a request's announcement, the cancel check every rank
    makes together after each prefill chunk and decode step), less the time the request's
    reader takes between two chunks; the meetings have bounds of their own. `begin` and
    `pause` are called from one thread (the engine); the watching thread, started with the
    first step, only reads (under the same lock: its check is one with their writes).

    Args:
        timeout_s: the longest a step may run (seconds).
        expired: what to do when one runs longer (it must not wait for the stuck thread).
        name: the watching thread's name.
    """

    def __init__(self, timeout_s: float, expired: Callable[[], None], name: str):
        self._timeout_s = timeout_s
        self._expired = expired
        self._name = name
        self._began: float | None = None  # when the step under way began (monotonic s)
        self._armed = threading.Condition()  # wakes the watcher when a step starts
        self._watcher: threading.Thread | None = None

    def begin(self) -> None:
        """A step begins now (a request's first, one after the ranks met, or after its reader
        took a chunk)."""
        with self._armed:
            self._began = time.monotonic()
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name=self._name, daemon=True)
                self._watcher.start()
            self._armed.notify()

    def pause(self) -> bool:
        """No step runs now (the request ended, its reader has a chunk to take, or the ranks
        are meeting); returns whether one was running. The watcher, woken at that step's
        deadline, finds none (or a later one). Under the lock: the watcher reads a step's
        start and then the clock, and a pause between the two would count as a step past it."""
        with self._armed:
            stepping, self._began = self._began is not None, None
        return stepping

    def _watch(self) -> None:
        """Waits until a step has run past the bound, then calls `expired`."""
        with self._armed:
            while (began := self._began) is None or time.monotonic() - began < self._timeout_s:
                wait_s = None if began is None else began + self._timeout_s - time.monotonic()
                self._armed.wait(wait_s)
        self._expired()


class AgreedCancel:
    """A request's cancel flag as every rank sees it: set on rank 0 (by `Runner.cancel`, the
    caller's Event or a client that left), and read together at every check.

    Every rank must call `is_set` at the same points: the Runner's code does, because each
    rank runs the same request through the same steps.
    """

    def __init__(self, event: threading.Event, lockstep: Lockstep):
        self._event = event
        self._lockstep = lockstep

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._lockstep.agree(self._event.is_set())


def drain(chunks: Iterator[Any], cancelled: AgreedCancel, watchdog: StepWatchdog) -> Iterator[Any]:
    """Yields `chunks`; if the caller stops reading, cancels and runs them to the agreed stop
    (the followers are still running the same request and must reach the same end). The
    `watchdog` is paused while the caller holds a chunk."""
    try:
        for chunk in chunks:
            watchdog.pause()
            yield chunk
            watchdog.begin()
    except GeneratorExit:
        watchdog.begin()
        cancelled.set()
        for _ in chunks:
            pass
        raise
