"""Building a `Request` from a call's arguments, before it may touch the cache.

Owns `RequestBuilder`: sampling settings checked, the prompt encoded and fitted to the context
window, the tokens no cut may drop (`keep`), the length of the chat template's generation
prompt, and the opaque isolation domain a `cache_salt` stands for (`salt_digest`). Everything
that can be wrong with a call raises here, in the caller's thread, before any model work.

Does not own the cut itself (`context.fit_prompt`), prompt encoding (`text.prompt`) or the
request's fields and checks (`request`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, NoReturn

from mlxkv.cache.prefix import common_prefix_lengths
from mlxkv.config import DEFAULT_KEEP_TOKENS
from mlxkv.decoding.grammar import check_grammar
from mlxkv.decoding.sampling import SamplingParams
from mlxkv.errors import ContextLengthError
from mlxkv.runner.context import chat_cut, fit_prompt
from mlxkv.runner.request import Request, RequestOptions
from mlxkv.runner.text.landmarks import Landmarks
from mlxkv.runner.text.messages import Message, Tools, leading_system_messages
from mlxkv.runner.text.prompt import Prompt, PromptEncoder
from mlxkv.runner.text.replies import ReplyStart, StoredReplyIds, replies_for
from mlxkv.runner.text.tokenizer_facts import TokenFloor
from mlxkv.runner.text.vision import ImageTokens, VisionPrompts, has_images, with_text_content
from mlxkv.runner.text.vision_cuts import ImageChat

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


class RequestBuilder:
    """Builds Requests for one model and context window.

    Args:
        prompts: the model's prompt encoder.
        max_context: the window, in tokens.
        keep: the Runner's `keep` setting (None: the system prompt, else 4 tokens).
        vision: renders prompts with images (refusing them for a text-only model).
        stored_reply: the disk tier's lookup of a reply the memory dropped (None: no tier).
    """

    def __init__(
        self,
        prompts: PromptEncoder,
        max_context: int,
        keep: int | None,
        vision: VisionPrompts,
        stored_reply: StoredReplyIds | None = None,
    ):
        self._prompts = prompts
        self._max_context = max_context
        self._keep = keep
        self._vision = vision
        # recent replies' ids, which assistant messages sent back take (`text.replies`)
        self._replies = replies_for(prompts.tokenizer)
        self._floor = TokenFloor(prompts.tokenizer)
        self._stored_reply = stored_reply

    def build(
        self,
        prompt: Prompt,
        sampling: dict[str, Any],
        options: RequestOptions,
        *,
        cached_prefix: Callable[..., int],
        cut_starts: Callable[[str | None], Sequence[Message]],
    ) -> Request:
        """The request for `prompt`, cut to the window if it must be: a chat preferably where
        one of `cut_starts(salt)` (cuts the cache entries of its isolation domain hold, newest
        first) begins; `cached_prefix(tokens, salt=salt)` tells how much of a candidate those
        entries hold. Both are asked only for a prompt that must be cut.

        Raises:
            ValueError: bad input; ContextLengthError for a prompt that cannot fit.
        """
        params = _sampling_params(sampling, self._prompts.vocab_size)
        salt = salt_digest(options.cache_salt)
        if has_images(prompt):  # rendered by the model's processor, replies as their ids
            return self._image_request(prompt, params, options, salt, cached_prefix, cut_starts)
        prompt = with_text_content(prompt)
        template = self._template_args(prompt, options, salt)
        if not options.truncate:
            self._refuse_far_past_the_window(prompt, options)
        tokens = self._prompts.encode(prompt, **template)
        render = functools.partial(self._prompts.chat.render, **template)
        if not options.truncate and len(tokens) >= self._max_context:
            self._refuse_too_long(len(tokens))
        params = self._fit_max_tokens(params, len(tokens), options.overflow)
        marks = self._prompts.landmarks.find(
            prompt, tokens, system_tokens=self._keep is None, **template
        )
        keep = self._keep_for(tokens, marks)
        # a prompt that must be cut leaves room to answer: the answer begins with no shift
        budget = self._max_context
        if len(tokens) > budget:
            budget -= max(1, min(params.max_tokens, self._max_context // 4))
        chat = None
        if marks.chat and len(tokens) > budget:  # `fit_prompt` cuts only such a prompt
            chat = chat_cut(prompt, marks.system, render, cut_starts(salt))
        held = functools.partial(cached_prefix, salt=salt)
        fitted = fit_prompt(tokens, budget, keep, cached_prefix=held, chat=chat)
        cut_start = None if fitted.first_message is None else prompt[fitted.first_message]
        return self._request(
            options,
            salt,
            tokens=fitted.tokens,
            keep=keep,
            header_tokens=marks.header_tokens,
            params=params,
            cut_start=cut_start,
            reply_start=_held_start(marks.reply_start, fitted.tokens),
            continues_text=not marks.chat,
        )

    def _request(self, options: RequestOptions, salt: str | None, **prompt: Any) -> Request:
        """The Request of a `prompt` (its tokens, keep, header, settings, cuts) with what
        every prompt takes from its options; a grammar is checked against the tokenizer."""
        if options.grammar is not None:
            check_grammar(options.grammar, self._prompts.tokenizer)
        if options.prompt_logprobs is not None and prompt.get("images"):
            raise ValueError(
                "prompt_logprobs is not supported for a prompt with images (an image's "
                "positions are not vocabulary tokens); leave out the images or prompt_logprobs"
            )
        return Request(
            progress=options.progress,
            matched=options.matched,
            cancelled=options.cancel or threading.Event(),
            top_logprobs=options.top_logprobs,
            prompt_logprobs=options.prompt_logprobs,
            cache_key=options.cache_key,
            drops_before=options.drops_before,
            evict_first=options.evict_first,
            # drafts verified k at a time would each need the grammar's state: off (a prompt
            # with images drafts n-grams, verified on the bound model: the draft model cannot
            # read images)
            speculative=None if options.grammar is not None else options.speculative,
            grammar=options.grammar,
            cache_salt=salt,
            reply_key=options.reply_key,
            **prompt,
        )

    def _image_request(
        self,
        prompt: Sequence[Message],
        params: SamplingParams,
        options: RequestOptions,
        salt: str | None,
        cached_prefix: Callable[..., int],
        cut_starts: Callable[[str | None], Sequence[Message]],
    ) -> Request:
        """The request for chat messages with images. A prompt over the window is cut at
        message boundaries only (whole oldest messages after the system prompt, as a text
        chat is: never inside an image, and the kept messages' positions are those of a fresh
        prompt); so is the prompt of a reply that reaches the window ("shift"), mid-reply
        (`text.vision_cuts`). A reply with no message to drop stops at the window."""
        # the prompt's text parts stay as sent, but a reply sent back is found by its text
        template = self._template_args(with_text_content(prompt), options, salt)
        render = functools.partial(self._vision.encode, **template)
        encoded = render(prompt)
        keep = self._keep if self._keep is not None else DEFAULT_KEEP_TOKENS
        cut_start = None
        if len(encoded.tokens) >= self._max_context:
            if not options.truncate:
                self._refuse_too_long(len(encoded.tokens))
            held = functools.partial(cached_prefix, salt=salt)
            chat = ImageChat(prompt, render, cut_starts(salt))
            encoded, first = self._image_cut(chat, encoded, params, held)
            cut_start = prompt[first]
            prompt = leading_system_messages(prompt) + list(prompt[first:])
        tokens = encoded.tokens
        keep = min(keep, len(tokens))
        fitted, reply_cuts = self._reply_window(
            ImageChat(prompt, render), params, len(tokens), options
        )
        bare = self._vision.encode(prompt, **template, add_generation_prompt=False).tokens
        header = max(1, len(tokens) - common_prefix_lengths(tokens, [bare])[0])
        return self._request(
            options,
            salt,
            tokens=tokens,
            keep=keep,
            header_tokens=header,
            params=fitted,
            cut_start=cut_start,
            images=encoded.spans,
            reply_cuts=reply_cuts,
            reply_start=_held_start(encoded.reply_start, tokens),
        )

    def _reply_window(
        self, chat: ImageChat, params: SamplingParams, prompt_tokens: int, options: RequestOptions
    ) -> tuple[SamplingParams, ImageChat | None]:
        """The sampling settings and reply cuts of a prompt with images: a reply that may pass
        the window ("shift") cuts `chat` at message boundaries when it gets there; with no
        message to drop, or "stop", max_tokens is lowered to the room left (logged)."""
        room = self._max_context - prompt_tokens
        if options.overflow == "shift" and params.max_tokens > room and chat.can_cut:
            return params, chat
        fitted = self._fit_max_tokens(params, prompt_tokens, _no_shift(options.overflow))
        if fitted.max_tokens < params.max_tokens:
            logger.info(
                "reply with images limited to the window: max_tokens=%d (asked %d): %s",
                fitted.max_tokens,
                params.max_tokens,
                "overflow=stop"
                if options.overflow == "stop"
                else "no whole message to drop mid-reply (one user message after the system "
                "prompt; images are never shifted out)",
            )
        return fitted, None

    def _image_cut(
        self,
        chat: ImageChat,
        encoded: ImageTokens,
        params: SamplingParams,
        cached_prefix: Callable[[Sequence[int]], int],
    ) -> tuple[ImageTokens, int]:
        """A prompt with images cut to the window: whole messages dropped as `fit_prompt`
        drops a text chat's (with room left to answer), re-rendered through the processor.

        Raises:
            ContextLengthError: the last user message with the system prompt does not fit.
        """
        budget = self._max_context - max(1, min(params.max_tokens, self._max_context // 4))
        first, kept = chat.cut(encoded.tokens, budget, cached_prefix)
        logger.info(
            "context: a prompt with images cut at message %d of %d: %d of %d tokens kept "
            "(whole messages only; images are never split)",
            first,
            len(chat.messages),
            len(kept.tokens),
            len(encoded.tokens),
        )
        return kept, first

    def encode(
        self,
        prompt: Prompt,
        *,
        parse_control_tokens: bool = False,
        tools: Tools | None = None,
        switches: dict[str, Any] | None = None,
        salt: str | None = None,
    ) -> list[int]:
        """The token ids `prompt` becomes as a request of isolation domain `salt` would feed
        them (`Runner.encode`): through the model's processor with images, else through the
        chat template; either way with the domain's replies sent back taking their generated
        ids."""
        template = {"parse_control_tokens": parse_control_tokens, "tools": tools}
        template["switches"] = switches
        images, joined = has_images(prompt), with_text_content(prompt)
        template["replies"] = self._replies.known_in(joined, salt, self._stored_reply).get
        if images:  # the text parts as sent: the processor's template renders them
            return self._vision.encode(prompt, **template).tokens
        return self._prompts.encode(joined, **template)

    def _template_args(
        self, prompt: Prompt, options: RequestOptions, salt: str | None
    ) -> dict[str, Any]:
        """How the prompt is rendered: the request's settings, and the ids of the replies of
        its isolation domain that it sends back (`text.replies`)."""
        return {
            "parse_control_tokens": options.parse_control_tokens,
            "tools": options.tools,
            "switches": options.switches,
            "replies": self._replies.known_in(prompt, salt, self._stored_reply).get,
        }

    def _refuse_far_past_the_window(self, prompt: Prompt, options: RequestOptions) -> None:
        """Refuses, before its text is tokenized, a prompt that its length alone puts at least
        twice over the window (`TokenFloor`: no template's few tokens more or less
        bridge that), counted as the fewest tokens it can take."""
        past = 2 * self._max_context
        switches = self._prompts.chat.template_switches(options.switches)
        at_least = self._floor.prompt_tokens_at_least(
            self._prompts.tokenizer, prompt, past, tools=options.tools, **switches
        )
        if at_least >= past:
            logger.info("prompt refused untokenized: at least %d tokens", at_least)
            self._refuse_too_long(at_least, qualifier="at least ")

    def _refuse_too_long(self, prompt_tokens: int, qualifier: str = "") -> NoReturn:
        raise ContextLengthError(
            f"the prompt is {qualifier}{prompt_tokens:,} tokens and the context holds "
            f"{self._max_context:,}"
            " (at least 1 must stay free for the answer); shorten the prompt or raise "
            "max_context",
            prompt_tokens=prompt_tokens,
            max_context=self._max_context,
        )

    def _fit_max_tokens(
        self, params: SamplingParams, prompt_tokens: int, overflow: str
    ) -> SamplingParams:
        """`params` whose max_tokens the window holds after the prompt, as `overflow` says."""
        room = self._max_context - prompt_tokens
        if overflow == "shift" or params.max_tokens <= room:
            return params
        if overflow == "stop":
            return dataclasses.replace(params, max_tokens=max(room, 0))
        raise ContextLengthError(
            f"the prompt is {prompt_tokens:,} tokens and max_tokens is {params.max_tokens:,}: "
            f"together over the context of {self._max_context:,}; lower max_tokens to at most "
            f"{max(room, 0):,} or shorten the prompt",
            prompt_tokens=prompt_tokens,
            max_tokens=params.max_tokens,
            max_context=self._max_context,
        )

    def _keep_for(self, tokens: list[int], marks: Landmarks) -> int:
        """Tokens truncation and shifts never drop: the setting, else the system prompt."""
        if self._keep is not None:
            return self._keep
        if not marks.system:
            return min(DEFAULT_KEEP_TOKENS, len(tokens))
        return marks.system_tokens


def _held_start(start: ReplyStart | None, tokens: list[int]) -> ReplyStart | None:
    """`start` where the prompt's `tokens` (cut to the window) still end with its ids."""
    if start is None or len(tokens) < len(start.ids) or tokens[-len(start.ids) :] != start.ids:
        return None
    return start


def _no_shift(overflow: str) -> str:
    """The overflow mode for a prompt with images: "stop" in place of "shift"."""
    return "stop" if overflow == "shift" else overflow


def _sampling_params(sampling: dict[str, Any], vocab_size: int) -> SamplingParams:
    """The request's settings, checked; a `logit_bias` id outside the model's logits is a
    ValueError (mlx-lm's processor would index them past their end)."""
    unknown = sorted(set(sampling) - set(_SAMPLING_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown generation settings {', '.join(unknown)}; use {', '.join(_SAMPLING_FIELDS)}"
        )
    params = SamplingParams(**sampling)
    outside = [token for token, _ in params.logit_bias if token >= vocab_size]
    if outside:
        raise ValueError(
            f"logit_bias: token id {outside[0]} is not in the model's vocabulary of "
            f"{vocab_size:,} tokens (ids 0 to {vocab_size - 1:,})"
        )
    return params


def salt_digest(cache_salt: str | None) -> str | None:
    """The isolation domain of a request's `cache_salt` (kept instead of the salt itself,
    which may be a secret): None, the shared domain, for no salt."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be a non-empty str or None, got {cache_salt!r}")
    return hashlib.sha256(f"mlxkv-cache-salt\n{cache_salt}".encode()).hexdigest()[:32]
