"""Cutting a chat with images to the context window at message boundaries: a prompt over the
window (before anything runs) and a reply that reaches the window (mid-reply).

Owns: `ImageChat` (a chat with images, its renders by first kept message and its cut to a
budget) and `ImageWindow` (the `make_room` of a reply with images). Does not own choosing the
cut (`mlxkv.runner.context.choose_cut`), rendering (`VisionPrompts`) nor the text model's
shift (`mlxkv.runner.context.ContextWindow`).

Why a reply with images is not shifted in place: a text model's shift rotates the kept keys
back by the dropped count, exact only for 1-D RoPE positions; M-RoPE positions are not the
token index after an image, and a shift by tokens could split an image. So when a reply reaches
the window, whole oldest messages are dropped, the cache is cleared and the kept messages (their
images' encoder outputs from the encoder cache, their positions those of a fresh prompt) and
the reply so far are prefilled again: the seeds' full-clear fallback, cut at message
boundaries. The cache then holds exactly what a fresh prefill of the cut conversation and the
reply so far gives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxkv.cache.model_cache import ModelCache
from mlxkv.errors import ContextLengthError
from mlxkv.models.vision import ImagePrompt
from mlxkv.runner.context import chat_cut, check_keep, choose_cut
from mlxkv.runner.prompt_cache.entry import CacheEntry
from mlxkv.runner.text.messages import Message, leading_system_messages
from mlxkv.runner.text.vision import ImageTokens

logger = logging.getLogger(__name__)


class ImageChat:
    """A chat with images that may be cut at its user messages after the first (whole oldest
    messages after the system prompt dropped; an image never split). Each cut is rendered
    through the processor once and kept.

    Args:
        messages: the chat.
        render: the token record and images of messages (`VisionPrompts.encode`, with the
            request's template settings and the generation prompt).
        cut_starts: the first messages of cuts the cache holds, newest first (preferred).
    """

    def __init__(
        self,
        messages: Sequence[Message],
        render: Callable[[list[Message]], ImageTokens],
        cut_starts: Sequence[Message] = (),
    ):
        self.messages = list(messages)
        system = leading_system_messages(self.messages)
        self._system_messages = len(system)
        self.start = len(system)  # the first message kept now (moved by a reply's cut)
        self._render = render
        self._renders: dict[int, ImageTokens] = {}
        self._chat = chat_cut(self.messages, system, self._tokens_of, cut_starts)

    @property
    def can_cut(self) -> bool:
        """Whether any whole message can be dropped (a user message after the first)."""
        return bool(self._chat.cut_points)

    def _tokens_of(self, kept: list[Message]) -> list[int]:
        first = len(self.messages) - len(kept) + self._system_messages
        self._renders[first] = self._render(kept)
        return self._renders[first].tokens

    def cut(
        self,
        tokens: list[int],
        budget: int,
        cached_prefix: Callable[[Sequence[int]], int] = lambda tokens: 0,
    ) -> tuple[int, ImageTokens]:
        """The first message kept and the render of the chat `tokens` (longer than `budget`)
        cut to at most `budget` tokens, as `fit_prompt` cuts a chat (`choose_cut`; the caller
        logs it). Renders shrink as the cut moves later, so a reply's second cut, its prompt
        longer than the budget, falls past its first.

        Raises:
            ContextLengthError: no cut fits.
        """
        check_keep(1, budget)
        first, _ = choose_cut(self._chat, budget, cached_prefix, len(tokens))
        return first, self._renders[first]


@dataclass
class ImageWindow:
    """The window a reply with images generates in (`make_room`, as `ContextWindow`'s).

    Attributes:
        max_context: most tokens the cache may hold.
        chat: the request's prompt as messages (`Request.reply_cuts`).
        model: the model bound to the prompt's images; rebound to the cut prompt's.
        entry: the request's cache entry; its `cut_start` follows the cut, so the
            conversation's next turn cuts there too and reuses the entry.
        refill: feeds tokens into the cache without sampling.
    """

    max_context: int
    chat: ImageChat
    model: ImagePrompt
    entry: CacheEntry
    refill: Callable[[ModelCache, list[int]], None]

    def make_room(self, cache: ModelCache, num_new: int) -> bool:
        """Where feeding `num_new` more tokens would overflow the window: drops the oldest
        whole messages, so that the kept prompt and the reply so far take at most half the
        room left (or else all of it), and prefills both again. False (no room made; the reply
        ends with "length") where no later user message is left to cut at."""
        held = cache.num_tokens
        if held + num_new <= self.max_context:
            return True
        prompt = self.model.prompt
        reply = cache.tokens[len(prompt) :]
        budget = self.max_context - len(reply) - num_new
        try:
            first, kept = self.chat.cut(prompt, budget)
        except ContextLengthError:
            logger.info(
                "context: a reply with images stopped at the window of %d tokens after %d "
                "tokens: no whole message after message %d can be dropped to make room "
                "(images are never split; finish_reason length)",
                self.max_context,
                len(reply),
                self.chat.start,
            )
            return False
        cache.free()
        self.model.rebind(kept.tokens, kept.spans)
        self.refill(cache, kept.tokens + reply)
        self.chat.start = first
        self.entry.cut_start = self.chat.messages[first]
        logger.info(
            "context: a reply with images reached the window: prompt cut at message %d of %d, "
            "%d of %d prompt tokens and the reply's %d tokens kept, prefilled again (whole "
            "messages only; images are never split)",
            first,
            len(self.chat.messages),
            len(kept.tokens),
            len(prompt),
            len(reply),
        )
        return True
