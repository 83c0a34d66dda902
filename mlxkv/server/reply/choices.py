"""Several replies to one request (OpenAI's `n`, and the text completions' list of
prompts): `n` generations of each prompt, each sampled on its own, all started from prompts
prepared once (`start`). A prompt is computed once: its other choices wait for the prefix
the first feeds (`runner.request_run`) and take it from the cache; they then decode
together (seeded ones one after another: a seeded draw does not batch).

Owns `start_choices`, `Choices` (the request's turns seen as one where the server waits on or
stops its generation: the access line, `ReleaseModels`, a stream's end), `choice_seed` and
`combined` (one Completion for the usage and the log: each prompt once, cached as the choice
that computed it saw it, every choice's tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from mlxkv.runner.results import Completion
from mlxkv.server.reply.start import PreparedTurn
from mlxkv.server.reply.turn import Turn


class Choices:
    """The turns of one request's choices, `num_choices` for each prompt in turn."""

    def __init__(self, turns: list[Turn], num_choices: int):
        self.turns = turns
        self.num_choices = num_choices

    def cancel(self) -> None:
        for turn in self.turns:
            turn.cancel()

    async def finished(self) -> Completion | None:
        """`Turn.finished` of them all, `combined`; None if none ended."""
        return combined([await turn.finished() for turn in self.turns], self.num_choices)


async def start_choices(prompts: Sequence[PreparedTurn], num_choices: int) -> Choices:
    """`num_choices` generations of each of `prompts` (turns by prompt, then choice), in
    places of the worker's queue held for them all at once (`GenerationWorker.hold_places`);
    with a `seed`, each choice of a prompt its own (`choice_seed`), the same for every
    prompt (each prompt's choices are those of a request of it alone). All but a prompt's
    first choice: a cache entry evicted first (a request of six choices pushed other clients'
    conversations out of the cache: its client goes on with one reply). All but the very
    first: no deadline for their turn (`queue_timeout_s`: once the first has its turn, the
    others wait behind their own request's, and expired while the first ran). One that fails
    to start cancels those before it (they stay the request's turn, which the access line and
    `ReleaseModels` wait for, until they end).

    Raises:
        ApiError: 400 for more than the worker's `max_queue`, 429 where they do not fit now.
    """
    num_turns = len(prompts) * num_choices
    places = None if num_turns == 1 else prompts[0].worker.hold_places(num_turns)
    choices = Choices([], num_choices)
    try:
        for prepared in prompts:
            seed = prepared.sampling.get("seed")
            for index in range(num_choices):
                extra: dict[str, Any] = {"places": places}
                if index:
                    extra["evict_first"] = True
                if seed is not None:
                    extra["seed"] = choice_seed(seed, index)
                choices.turns.append(await prepared.start(extra))
                if len(choices.turns) > 1:
                    choices.turns[-1].keep_queued()
    except BaseException:
        choices.cancel()
        raise
    finally:
        if places is not None:
            places.release()  # those not taken
        if len(choices.turns) > 1:  # each start kept its own
            prompts[0].request.state.turn = choices
    return choices


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `seed`: the seed itself for the first (as
    with one choice), then one drawn from both, so that choices differ and each is
    repeatable, and no choice of one seed is a choice of another (seed + index would make
    choice 1 of seed 11 choice 0 of seed 12: a client looping over seeds got duplicates)."""
    if index == 0:
        return seed
    return int(np.random.SeedSequence(seed, spawn_key=(index,)).generate_state(1, np.uint64)[0])


def combined(completions: Sequence[Completion | None], num_choices: int) -> Completion | None:
    """One Completion of a request's choices, in their order (`num_choices` a prompt; None
    for one that did not end): each prompt's tokens once, cached as the choice that computed
    it saw them (the fewest), summed over the prompts; every choice's generated and drafted
    tokens; each way they ended. None if none ended."""
    ended = [c for c in completions if c is not None]
    prompts = []
    for start in range(0, len(completions), num_choices):
        if chosen := [c for c in completions[start : start + num_choices] if c is not None]:
            prompts.append((chosen[0].prompt_tokens, min(c.cached_tokens for c in chosen)))
    if not ended:
        return None
    return dataclasses.replace(
        ended[0],
        prompt_tokens=sum(prompt for prompt, _ in prompts),
        cached_tokens=sum(cached for _, cached in prompts),
        generation_tokens=sum(c.generation_tokens for c in ended),
        drafted_tokens=sum(c.drafted_tokens for c in ended),
        accepted_tokens=sum(c.accepted_tokens for c in ended),
        finish_reason=",".join(dict.fromkeys(c.finish_reason for c in ended)),
    )
