"""One generation request, checked before it may touch the cache.

Owns: `Request` (a validated request: the prompt's tokens fitted to the window and everything it
runs with) and `RequestOptions` (how a call asks for it to be rendered and run, checked).

Does not own building one from a call's arguments (`request_builder`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxkv.decoding.prefill.chunks import ProgressCallback
from mlxkv.decoding.sampling import SamplingParams
from mlxkv.errors import check_int
from mlxkv.models.vision import ImageSpan
from mlxkv.runner.results import PromptUsage
from mlxkv.runner.text.messages import Message, Tools
from mlxkv.runner.text.replies import ReplyKey, ReplyStart
from mlxkv.runner.text.vision_cuts import ImageChat

# The most alternatives per token that logprobs reports (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
# What a max_tokens the window cannot hold does (see RequestOptions.overflow).
OVERFLOW_MODES = ("shift", "stop", "refuse")


@dataclass(frozen=True, kw_only=True)
class Request:
    """One validated request.

    Attributes:
        tokens: the prompt, already cut to fit the context.
        keep: leading tokens no cut or shift drops.
        header_tokens: tokens of the template's generation prompt at the end.
        params: sampling settings.
        progress: called as progress(done, total) in prompt tokens during prefill.
        matched: called with the prompt's usage once its match is final, before the prefill.
        cancelled: set by `Runner.cancel()` or by the caller that passed it.
        top_logprobs: None for no log-probabilities; else how many alternatives to report
            with each sampled token's own.
        prompt_logprobs: None, or how many alternatives to report with each prompt token's
            own log-probability (`GenerationChunk.prompt_logprobs`).
        cache_key: a label for the cache entry the request generates into (None: keep its
            label).
        drops_before: the prompt cache's deletions counted when it was made
            (`CachePool.deletions`): a deletion of `cache_key` since frees its entry at its end.
        evict_first: a later choice of a request (`CachePool.fetch_nearest`).
        speculative: the speculative decoding mode (`mlxkv.config.SPECULATIVE_MODES`); None
            with a grammar.
        grammar: an llguidance grammar every generated token must keep to (checked), or None.
        cache_salt: the isolation domain of the cache entries it may reuse (a digest), or None.
        cut_start: the first message kept when a chat was cut to the window (None: not cut);
            kept on the request's cache entry, so this conversation's next turn cuts there
            again and reuses the entry.
        images: the images in `tokens`, in order (empty: a text prompt).
        reply_cuts: for a prompt with images whose reply may pass the window ("shift"), the
            prompt's messages, cut at message boundaries when the reply reaches the window
            (`text.vision_cuts.ImageWindow`); None: nothing to cut, the reply stops there.
        reply_key: what the reply is known by when sent back, if not its text (`ReplyKey`).
        reply_start: where the prompt continues a last message (Anthropic's prefill), its text
            and the ids `tokens` end with for it: the reply is known by that text and its own
            together, as the client sends them back (`text.replies`); None: not continued.
        continues_text: a raw prompt (text or token ids, not chat messages): the reply goes
            on with its text, its first token's space kept ("France is" + " Paris").
    """

    tokens: list[int]
    keep: int
    header_tokens: int
    params: SamplingParams
    progress: ProgressCallback | None
    cancelled: threading.Event
    matched: Callable[[PromptUsage], None] | None = None
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    cache_key: str | None = None
    drops_before: int | None = None
    evict_first: bool = False
    speculative: str | None = None
    cut_start: Message | None = None
    grammar: str | None = None
    cache_salt: str | None = None
    images: tuple[ImageSpan, ...] = ()
    reply_cuts: ImageChat | None = None
    reply_key: ReplyKey | None = None
    reply_start: ReplyStart | None = None
    continues_text: bool = False


@dataclass(frozen=True, kw_only=True)
class RequestOptions:
    """How a request is rendered and run, besides its sampling settings (see `Runner.stream`);
    checked when made (ValueError), before the prompt is rendered.

    Attributes:
        progress: called as progress(done, total) in prompt tokens during prefill.
        matched: called with the prompt's usage once its match is final, before the prefill.
        parse_control_tokens: let control-token strings in message content and tool calls be
            control tokens.
        tools: function definitions for the chat template.
        cancel: an Event that ends this request when set; None makes a private one.
        top_logprobs: None for no log-probabilities, else alternatives per token (0..20).
        prompt_logprobs: the same for the prompt's own tokens.
        truncate: cut a prompt that does not fit; False raises ContextLengthError.
        overflow: what a `max_tokens` the window cannot hold after the prompt does: "shift"
            (the context shifts mid-reply), "stop" (the reply ends with "length" when the window
            is full) or "refuse" (ContextLengthError before anything runs).
        cache_key: a label for the cache entry this request generates into.
        drops_before: the prompt cache's deletions counted now (`Request.drops_before`).
        evict_first: a later choice of a request (`Request.evict_first`).
        speculative: the speculative decoding mode, already checked.
        grammar: an llguidance grammar (`decoding.grammar`) the output must keep to, or None.
        cache_salt: the caller's salt, a secret the request keeps only as its digest
            (`salt_digest`), or None.
        switches: chat-template variables (`enable_thinking`, ...), passed where the template
            reads them.
        reply_key: what the reply is known by when sent back, if not its text (`ReplyKey`).
    """

    progress: ProgressCallback | None = None
    matched: Callable[[PromptUsage], None] | None = None
    parse_control_tokens: bool = False
    tools: Tools | None = None
    cancel: threading.Event | None = None
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate: bool = True
    cache_key: str | None = None
    drops_before: int | None = None
    evict_first: bool = False
    speculative: str | None = None
    overflow: str = "shift"
    grammar: str | None = None
    cache_salt: str | None = dataclasses.field(default=None, repr=False)  # a secret: never shown
    switches: dict[str, Any] | None = None
    reply_key: ReplyKey | None = None

    def __post_init__(self) -> None:  # checked when made, before anything else
        if self.overflow not in OVERFLOW_MODES:
            raise ValueError(
                f"overflow must be one of {', '.join(OVERFLOW_MODES)}, got {self.overflow!r}"
            )
        for name in ("progress", "matched", "reply_key"):
            if (value := getattr(self, name)) is not None and not callable(value):
                raise ValueError(f"{name} must be a callable or None, got {type(value).__name__}")
        if self.cancel is not None and not isinstance(self.cancel, threading.Event):
            raise ValueError(
                f"cancel must be a threading.Event or None, got {type(self.cancel).__name__}"
            )
        if self.cache_key is not None and not isinstance(self.cache_key, str):
            raise ValueError(
                f"cache_key must be a str or None, got {type(self.cache_key).__name__}"
            )
        for name, top in (
            ("logprobs", self.top_logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ):
            if top is not None:
                check_int(f"{name} (alternatives per token)", top, low=0, high=MAX_TOP_LOGPROBS)
