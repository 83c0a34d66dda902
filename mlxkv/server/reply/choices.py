"""Several replies to one request (OpenAI's `n`): `n` generations of the same prompt, each
sampled on its own, all started from one prepared prompt (`start`). The prompt is computed
once: the others wait for the prefix the first feeds (`runner.request_run`) and take it from
the cache; they then decode together (seeded ones one after another: a seeded draw does not
batch).

Owns `start_choices`, `Choices` (the request's turns seen as one where the server waits on or
stops its generation: the access line, `ReleaseModels`, a stream's end), `choice_seed` and
`combined` (one Completion for the usage and the log: the prompt once, cached as the choice
that computed it saw it, every choice's tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mlxkv.runner.results import Completion
from mlxkv.server.reply.start import PreparedTurn
from mlxkv.server.reply.turn import Turn


class Choices:
    """The turns of one request's choices."""

    def __init__(self, turns: list[Turn]):
        self.turns = turns

    def cancel(self) -> None:
        for turn in self.turns:
            turn.cancel()

    async def finished(self) -> Completion | None:
        """`Turn.finished` of them all, `combined`; None if none ended."""
        ended = [c for c in [await turn.finished() for turn in self.turns] if c is not None]
        return combined(ended) if ended else None


async def start_choices(prepared: PreparedTurn, num_choices: int) -> Choices:
    """`num_choices` generations of `prepared`, in places of its worker's queue held for them
    all at once (`GenerationWorker.hold_places`); with a `seed`, each its own (`choice_seed`).
    All but the first: a cache entry evicted first (a request of six choices pushed other
    clients' conversations out of the cache: its client goes on with one reply), and no
    deadline for their turn (`queue_timeout_s`: once the first has its turn, the others wait
    behind their own request's choices, and expired while the first ran). One that fails to
    start cancels those before it (they stay the request's turn, which the access line and
    `ReleaseModels` wait for, until they end).

    Raises:
        ApiError: 400 for more than the worker's `max_queue`, 429 where they do not fit now.
    """
    places = None if num_choices == 1 else prepared.worker.hold_places(num_choices)
    seed = prepared.sampling.get("seed")
    choices = Choices([])
    try:
        for index in range(num_choices):
            extra: dict[str, Any] = {"places": places}
            if index:
                extra["evict_first"] = True
            if seed is not None:
                extra["seed"] = choice_seed(seed, index)
            choices.turns.append(await prepared.start(extra))
            if index:
                choices.turns[-1].keep_queued()
    except BaseException:
        choices.cancel()
        raise
    finally:
        if places is not None:
            places.release()  # those not taken
        if len(choices.turns) > 1:  # each start kept its own
            prepared.request.state.turn = choices
    return choices


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `seed`: the seed itself for the first (as
    with one choice), then one drawn from both, so that choices differ and each is
    repeatable, and no choice of one seed is a choice of another (seed + index would make
    choice 1 of seed 11 choice 0 of seed 12: a client looping over seeds got duplicates)."""
    if index == 0:
        return seed
    return int(np.random.SeedSequence(seed, spawn_key=(index,)).generate_state(1, np.uint64)[0])


def combined(completions: list[Completion]) -> Completion:
    """The first Completion with the prompt's cached tokens as the choice that computed the
    prompt saw them (the fewest), every choice's generated and drafted tokens, and each way
    they ended."""
    return dataclasses.replace(
        completions[0],
        cached_tokens=min(c.cached_tokens for c in completions),
        generation_tokens=sum(c.generation_tokens for c in completions),
        drafted_tokens=sum(c.drafted_tokens for c in completions),
        accepted_tokens=sum(c.accepted_tokens for c in completions),
        finish_reason=",".join(dict.fromkeys(c.finish_reason for c in completions)),
    )
