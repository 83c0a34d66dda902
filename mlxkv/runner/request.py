"""One generation request, built and checked before it may touch the cache.

Owns: `Request` (a validated request) and `RequestBuilder`, which turns a call's arguments into
one: sampling settings checked, the prompt encoded and fitted to the context window, the tokens
no cut may drop (`keep`), and the length of the chat template's generation prompt. Everything
that can be wrong with a call raises here, in the caller's thread, before any model work.

Does not own the cut itself (`context.fit_prompt`) or prompt encoding (`prompt`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from mlxkv.cache.prefix import common_prefix_length
from mlxkv.runner.context import DEFAULT_KEEP_TOKENS, ChatCut, fit_prompt
from mlxkv.runner.generate import ProgressCallback
from mlxkv.runner.prompt import (
    Message,
    Prompt,
    PromptEncoder,
    is_messages,
    leading_system_messages,
)
from mlxkv.runner.sampling import SamplingParams

_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


@dataclass(frozen=True)
class Request:
    """One validated request.

    Attributes:
        tokens: the prompt, already cut to fit the context.
        keep: leading tokens no cut or shift drops.
        header_tokens: tokens of the template's generation prompt at the end.
        params: sampling settings.
        progress: called as progress(done, total) in prompt tokens during prefill.
        cancelled: set by `Runner.cancel()`.
    """

    tokens: list[int]
    keep: int
    header_tokens: int
    params: SamplingParams
    progress: ProgressCallback | None
    cancelled: threading.Event


class RequestBuilder:
    """Builds Requests for one model and context window.

    Args:
        prompts: the model's prompt encoder.
        max_context: the window, in tokens.
        keep: the Runner's `keep` setting (None: the system prompt, else 4 tokens).
    """

    def __init__(self, prompts: PromptEncoder, max_context: int, keep: int | None):
        self._prompts = prompts
        self._max_context = max_context
        self._keep = keep
        self._cut_start: Message | None = None  # first message kept by the last chat cut

    def build(
        self,
        prompt: Prompt,
        sampling: dict[str, Any],
        progress: ProgressCallback | None,
        parse_control_tokens: bool,
        *,
        held: Sequence[int],
    ) -> Request:
        """Raises ValueError (ContextLengthError for a prompt that cannot fit) on bad input."""
        params = _sampling_params(sampling)
        if progress is not None and not callable(progress):
            raise ValueError(f"progress must be a callable or None, got {type(progress).__name__}")
        tokens = self._prompts.encode(prompt, parse_control_tokens=parse_control_tokens)
        keep = self._keep_for(prompt, tokens, parse_control_tokens)
        # A prompt that must be cut leaves room to answer, so the answer does not begin with a
        # shift.
        budget = self._max_context
        if len(tokens) > budget:
            budget -= max(1, min(params.max_tokens, self._max_context // 4))
        chat = self._chat_cut(prompt, parse_control_tokens) if is_messages(prompt) else None
        fitted = fit_prompt(tokens, budget, keep, held=held, chat=chat)
        if fitted.first_message is not None:
            self._cut_start = prompt[fitted.first_message]
        header = self._generation_prompt_length(prompt, tokens, parse_control_tokens)
        return Request(fitted.tokens, keep, header, params, progress, threading.Event())

    def forget_cut(self) -> None:
        """Called when the cache is dropped: no cut lives in it any more."""
        self._cut_start = None

    def _generation_prompt_length(
        self, prompt: Prompt, tokens: list[int], parse_control_tokens: bool
    ) -> int:
        """Tokens the chat template appends to open the assistant's turn (at least 1): the next
        turn re-renders from there, so it is where a checkpoint is most useful."""
        if not is_messages(prompt):
            return 1
        without = self._prompts.render(
            prompt, add_generation_prompt=False, parse_control_tokens=parse_control_tokens
        )
        return max(1, len(tokens) - common_prefix_length(without, tokens))

    def _keep_for(self, prompt: Prompt, tokens: list[int], parse_control_tokens: bool) -> int:
        """Tokens truncation and shifts never drop: the setting, else the system prompt."""
        if self._keep is not None:
            return self._keep
        system = leading_system_messages(prompt)
        if not system:
            return min(DEFAULT_KEEP_TOKENS, len(tokens))
        rendered = self._prompts.render(
            system, add_generation_prompt=False, parse_control_tokens=parse_control_tokens
        )
        return common_prefix_length(rendered, tokens)

    def _chat_cut(self, prompt: Sequence[Message], parse_control_tokens: bool) -> ChatCut:
        """How a chat may be cut: at user messages after the first, keeping the system prompt;
        the cut taken last time is preferred (found by its first message, newest first)."""
        system = leading_system_messages(prompt)
        points = [i for i in range(len(system) + 1, len(prompt)) if prompt[i].get("role") == "user"]
        preferred = next((i for i in reversed(points) if prompt[i] == self._cut_start), None)
        return ChatCut(
            render_from=lambda first: self._prompts.render(
                system + list(prompt[first:]), parse_control_tokens=parse_control_tokens
            ),
            cut_points=points,
            preferred=preferred,
        )


def _sampling_params(sampling: dict[str, Any]) -> SamplingParams:
    unknown = sorted(set(sampling) - set(_SAMPLING_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown generation settings {', '.join(unknown)}; use {', '.join(_SAMPLING_FIELDS)}"
        )
    return SamplingParams(**sampling)
