"""Living within the context window: fitting prompts, and shifting the cache when full.

Owns:
  - `fit_prompt`: a prompt longer than the window is cut from the front, keeping the first
    `keep` tokens (for chat messages, cut where `chat_cut` says: whole messages are dropped,
    oldest first, after the system prompt, so no template marker is split);
  - `ContextWindow.make_room`: when generation reaches the window, keep the first `keep`
    tokens, drop half of the rest and go on. Where every layer is a float KVCache with a RoPE
    whose angle is linear in the position (plain RoPE, traditional or not, linear scaling, and
    Llama 3 frequency scaling), the remaining keys are rotated back in place: RoPE composes, so
    a key rotated for position p and then by -d equals one rotated for p - d. Elsewhere
    (sliding-window or recurrent layers, quantized K/V, other RoPE kinds such as YaRN or
    LongRoPE, which are not claimed) the cache is cleared and the kept tokens prefilled again.

What a shift cannot restore: deeper layers' K/V of the kept tokens were computed while the
dropped tokens were in context. That approximation is the same in llama.cpp and Ollama; only
the first layer (and a one-layer model) equals a fresh prefill of the kept tokens exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxkv.cache.layers.kv import Rotation
from mlxkv.cache.model_cache import ModelCache
from mlxkv.errors import ContextLengthError
from mlxkv.runner.text.messages import Message

logger = logging.getLogger(__name__)


def check_keep(keep: int, budget: int) -> None:
    """Raises ContextLengthError when `keep` leaves no room in a window of `budget` tokens."""
    if keep >= budget:
        raise ContextLengthError(
            f"keep is {keep} tokens (the first tokens every cut keeps) but only {budget} fit "
            "in the context; raise max_context (--max-context on the command line) or lower "
            "keep (or shorten the system prompt)"
        )


@dataclass(frozen=True)
class ChatCut:
    """How `fit_prompt` may cut a chat: whole messages, oldest first, after the system prompt.

    Attributes:
        render_from: token ids of the chat keeping the system messages and messages[i:].
        cut_points: ascending message indices a cut may start at (chat templates expect the
            kept history to start with a user message).
        preferred: the cuts the cache probably holds (ones taken before, newest first); the
            one the cache shares most with is used, only when that is a quarter of the budget.
    """

    render_from: Callable[[int], list[int]]
    cut_points: Sequence[int]
    preferred: Sequence[int] = ()


def chat_cut(
    prompt: Sequence[Message],
    system: list[Message],
    render: Callable[[list[Message]], list[int]],
    cut_starts: Sequence[Message],
) -> ChatCut:
    """How a chat may be cut: at user messages after the first, keeping the system prompt
    (`system`, rendered with the kept messages by `render`); the cuts entries hold are
    preferred."""
    points = [i for i in range(len(system) + 1, len(prompt)) if prompt[i].get("role") == "user"]
    # each cut an entry holds, found by its first message (its latest such point), once: an
    # equal message of another chat ("continue") must not hide this chat's own cut
    found = (next((i for i in reversed(points) if prompt[i] == s), None) for s in cut_starts)
    preferred = list(dict.fromkeys(i for i in found if i is not None))
    return ChatCut(
        render_from=lambda first: render(system + list(prompt[first:])),
        cut_points=points,
        preferred=preferred,
    )


@dataclass(frozen=True)
class Fitted:
    """A prompt cut to the window: its tokens, and the first message kept (None: no chat
    cut was made)."""

    tokens: list[int]
    first_message: int | None = None


def fit_prompt(
    tokens: list[int],
    budget: int,
    keep: int,
    *,
    cached_prefix: Callable[[Sequence[int]], int] = lambda tokens: 0,
    chat: ChatCut | None = None,
) -> Fitted:
    """Returns `tokens` cut to at most `budget` tokens, keeping the first `keep`.

    Chat messages (`chat` given) are dropped whole, never splitting a template marker. The cut
    the cache holds (`chat.preferred`, verified with `cached_prefix`) is kept while it fits, so a
    conversation that lives cut in the cache is reused exactly. Otherwise the cut goes deep
    enough to fit in half the budget, so the next turns find the same start in the cache
    instead of missing on every turn (a cut's cost is paid once per half window, not once per
    turn). Rendering cost is O(log n) renders of at most about twice the window, so a long
    history costs time linear in its length (the full render), not quadratic.

    Args:
        cached_prefix: how many leading tokens of a token list the prompt cache holds.

    Raises:
        ContextLengthError: `keep` leaves no room in the budget, or the chat's last user turn
            (with the system prompt) alone is longer than the budget.
    """
    check_keep(keep, budget)
    if len(tokens) <= budget:
        return Fitted(tokens)
    if chat is None:
        cut = len(tokens) - budget
        logger.info(
            "context: dropped %d tokens after the first %d to fit %d tokens", cut, keep, budget
        )
        return Fitted(tokens[:keep] + tokens[keep + cut :])
    first, chosen = choose_cut(chat, budget, cached_prefix, len(tokens))
    logger.info(
        "context: dropped the messages before message %d (%d tokens) to fit %d tokens",
        first,
        len(tokens) - len(chosen),
        budget,
    )
    return Fitted(chosen, first)


def choose_cut(
    chat: ChatCut, budget: int, cached_prefix: Callable[[Sequence[int]], int], num_tokens: int
) -> tuple[int, list[int]]:
    """The first message kept and the render from it, as `fit_prompt` cuts a chat longer than
    `budget`, unlogged (a prompt with images logs its own cut, once); `num_tokens`: the whole
    prompt's, which is the shortest render when no message can be dropped."""
    renders = [(first, chat.render_from(first)) for first in chat.preferred]
    fitting = [(cached_prefix(ids), first, ids) for first, ids in renders if len(ids) <= budget]
    if fitting:
        most, first, candidate = max(fitting, key=lambda held: held[0])
        if most >= budget // 4:
            return first, candidate
    points = list(chat.cut_points)
    for limit in (budget // 2, budget):
        found = _first_fitting(points, chat.render_from, limit)
        if found is not None:
            return found
    shortest = len(chat.render_from(points[-1])) if points else num_tokens
    raise ContextLengthError(
        f"the last user message with the system prompt and what follows it takes {shortest:,} "
        f"tokens; "
        f"only {budget} tokens fit in the context with room left to answer. Shorten that "
        "message or raise max_context"
    )


def _first_fitting(
    points: list[int], render_from: Callable[[int], list[int]], limit: int
) -> tuple[int, list[int]] | None:
    """The earliest cut point whose render fits in `limit` tokens (renders shrink as the cut
    moves later), found by galloping back from the latest cut and then bisecting, so only
    O(log n) renders of about the fitting size are made."""
    rendered: dict[int, list[int]] = {}

    def fits(i: int) -> bool:
        if i not in rendered:
            rendered[i] = render_from(points[i])
        return len(rendered[i]) <= limit

    if not points or not fits(len(points) - 1):
        return None
    good, bad, step = len(points) - 1, -1, 1
    while good - step >= 0:
        if not fits(good - step):
            bad = good - step
            break
        good -= step
        step *= 2
    while good - bad > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return points[good], rendered[good]


@dataclass
class ContextWindow:
    """The window one request generates in.

    Attributes:
        max_context: most tokens the cache may hold.
        keep: tokens at the start that a shift never drops.
        rotations: per-layer key rotations (`rope_rotations`); None entries force reprocessing.
        refill: feeds tokens into the cache without sampling (used when a shift reprocesses).
        on_shift: told (keep, drop, num_held) after each shift, which dropped the tokens
            [keep, keep + drop) of the `num_held` held: a draft model follows the same cut.
    """

    max_context: int
    keep: int
    rotations: Sequence[Rotation | None]
    refill: Callable[[ModelCache, list[int]], None]
    on_shift: Callable[[int, int, int], None] | None = None
    shifts: int = 0

    def make_room(self, cache: ModelCache, num_new: int) -> bool:
        """Shifts the cache if feeding `num_new` more tokens would overflow the window; always
        makes room (True)."""
        held = cache.num_tokens
        if held + num_new <= self.max_context:
            return True
        drop = max((held - self.keep) // 2, held + num_new - self.max_context)
        self.shifts += 1
        if cache.can_shift(self.rotations):
            cache.shift(self.keep, drop, self.rotations)
            logger.info(
                "context shift: kept %d + %d tokens, dropped %d",
                self.keep,
                held - self.keep - drop,
                drop,
            )
        else:
            self._reprocess(cache, drop)
        if self.on_shift is not None:
            self.on_shift(self.keep, drop, held)
        return True

    def _reprocess(self, cache: ModelCache, drop: int) -> None:
        """The shift of a cache that cannot rotate in place: the kept tokens prefilled again."""
        kept = cache.tokens
        del kept[self.keep : self.keep + drop]
        cache.free()
        self.refill(cache, kept)
        logger.info(
            "context shift by reprocessing %d tokens (dropped %d): this model's cache cannot "
            "be rotated in place",
            len(kept),
            drop,
        )
