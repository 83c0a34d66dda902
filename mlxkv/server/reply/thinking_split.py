"""The model's thinking, split out of its generated text as it streams, for every API.

Owns: `ThinkingSplitter` (streamed text in; `Thought`s and answer text out, at the model's
thinking tags: mlx-lm's `TokenizerWrapper.think_start` / `think_end`, such as Qwen3's and
DeepSeek-R1's `<think>` / `</think>`) and `output_start` (where the prompt leaves the output:
inside a thinking block or not, right after a tag or not; `renders_whole`: whether it renders
the whole prompt to say). Does not own the API formats, nor the thinking switches
(`reply.thinking_switch`).

Terms:
  - thought: text between a start tag and an end tag; the answer is the rest.
  - The tags switch between the two as mlx-lm's text state machine does: a start tag in the
    answer opens a thought, an end tag in a thought closes it, and a tool-call start marker
    in a thought also closes it (a model that calls a tool before closing its thinking),
    staying in the answer for the tool-call parser. A tag that switches is dropped, with the
    whitespace right after it (Qwen3 writes `</think>\\n\\n`, as Ollama's parser trims); any
    other text passes through, a tag that does not switch included.
  - A partial tag at the end of a chunk is held back until the next chunk says what it is,
    so neither stream ever shows part of a tag.
  - A continued last assistant message (`CONTINUE_FINAL`, Anthropic's prefill) leaves the
    output where its text ends: inside a thought it opened (`<think>\nLet me` goes on as
    thinking), in the answer after one it closed, mid-text (whitespace kept) or after a tag.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxkv.runner.text.chat import continues_final
from mlxkv.runner.text.stop_strings import partial_suffix_length
from mlxkv.runner.text.vision import with_text_content

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Thought:
    """A piece of the model's thinking."""

    text: str


@dataclass(frozen=True, kw_only=True)
class OutputStart:
    """Where a prompt leaves its output.

    Attributes:
        thinking: inside a thought (the prompt opened one it did not close).
        after_tag: right after a thinking tag (and whitespace): the whitespace the output
            begins with opens the section, dropped as after a tag in the output; False: the
            output goes on with text the prompt began (a continued message's).
    """

    thinking: bool
    after_tag: bool


class ThinkingSplitter:
    """Splits a stream of text into `Thought`s and answer text (`str`), in order.

    Args:
        start, end: the model's thinking tags.
        thinking: whether the text begins inside a thought (`output_start`).
        after_tag: whether it begins right after a tag (`OutputStart.after_tag`); by default
            where it begins inside a thought.
        exits: markers that close a thought and stay in the answer (the tool-call start).
    """

    def __init__(
        self,
        start: str,
        end: str,
        *,
        thinking: bool,
        after_tag: bool | None = None,
        exits: Sequence[str] = (),
    ):
        self._start = start
        self._end = end
        self._exits = tuple(marker for marker in exits if marker)
        self._thinking = thinking
        # drop the whitespace that opens the next section
        self._trim = thinking if after_tag is None else after_tag
        self._buffer = ""

    @property
    def thinking(self) -> bool:
        """Whether a thought is open now."""
        return self._thinking

    def push(self, text: str) -> list[Thought | str]:
        """Adds generated text; returns what is now known to be thought or answer."""
        self._buffer += text
        pieces: list[Thought | str] = []
        while True:
            if self._trim:
                self._buffer = self._buffer.lstrip()
                if not self._buffer:
                    return pieces
                self._trim = False
            markers = (self._end, *self._exits) if self._thinking else (self._start,)
            found = [(at, m) for m in markers if (at := self._buffer.find(m)) >= 0]
            if not found:
                hold = partial_suffix_length(self._buffer, markers)
                safe = self._buffer[: len(self._buffer) - hold]
                self._buffer = self._buffer[len(safe) :]
                return pieces + self._piece(safe)
            at, marker = min(found, key=lambda hit: hit[0])
            pieces += self._piece(self._buffer[:at])
            if marker in (self._start, self._end):
                self._buffer = self._buffer[at + len(marker) :]
                self._trim = True
            else:  # a tool call: the marker is the answer's
                self._buffer = self._buffer[at:]
            self._thinking = not self._thinking

    def finish(self) -> list[Thought | str]:
        """What is held back at the end of generation (a cut-off partial tag is text)."""
        rest, self._buffer = self._buffer, ""
        return self._piece(rest)

    def _piece(self, text: str) -> list[Thought | str]:
        if not text:
            return []
        return [Thought(text) if self._thinking else text]


def output_start(
    runner: Any,
    prompt: Sequence[dict[str, Any]] | str | list[int],
    switches: dict | None,
) -> OutputStart:
    """Where the output of `prompt` begins: inside a thought where the prompt opens a thinking
    block it does not close (templates that end the generation prompt with the start tag, as
    DeepSeek-R1's and Qwen3's thinking-only ones do; mlx-lm's server reads it the same way, as
    a continued message that opened one does), and whether right after a tag.

    Chat messages are judged by the chat template's generation prompt, rendered for a
    one-message conversation with the same `switches` (the full prompt is not rendered a
    second time); a continued last message (`continues_final`) by the whole render (its end
    is that message's text, as the template writes it; without the tools, which render before
    it); text by its end, as Ollama does; token ids by their last tags.
    """
    tokenizer = runner.tokenizer
    if isinstance(prompt, str):
        tail = prompt.rstrip()
        thinking = tail.endswith(tokenizer.think_start)
        return OutputStart(
            thinking=thinking, after_tag=thinking or tail.endswith(tokenizer.think_end)
        )
    tokens = prompt
    if prompt and isinstance(prompt[0], dict):
        # the shortest conversation a template renders a generation prompt for
        probe = [{"role": "user", "content": "?"}]
        whole = renders_whole(prompt, switches)
        try:
            tokens = runner.encode(prompt if whole else probe, switches=switches)
        except ValueError as error:  # a template that wants more than one user message
            logger.debug("thinking probe not rendered (%s); output read as the answer", error)
            return OutputStart(thinking=False, after_tag=False)
    return _after_tags(tokenizer, tokens)


def renders_whole(prompt: Any, switches: dict | None) -> bool:
    """Whether `output_start` renders the whole `prompt` again (a continued last message's:
    a caller on the event loop runs it off the loop), not a one-message probe."""
    chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    return chat and continues_final(with_text_content(prompt), switches)


def _after_tags(tokenizer: Any, tokens: Sequence[int]) -> OutputStart:
    """Where output after `tokens` begins, by their last thinking tag."""
    opened, closed = tokenizer.rfind_think_start(tokens), tokenizer.rfind_think_end(tokens)
    last = max(opened, closed)
    after_tag = last >= 0 and not tokenizer.decode(list(tokens[last + 1 :])).strip()
    return OutputStart(thinking=opened > closed, after_tag=after_tag)


def checked_reasoning(messages: Any, tokenizer: Any) -> Any:
    """`messages` (chat messages; any other prompt as it is) with each earlier turn's
    `reasoning_content` that holds a control token's text (`<|im_end|>`, ...) left out: the
    engine keeps message content as text, but a template renders this field as it is, so a
    client could forge turns through it. Only the cache reuse of that turn is lost."""
    if not isinstance(messages, list) or not any(
        isinstance(m, dict) and m.get("reasoning_content") for m in messages
    ):
        return messages
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    controls = [t.content for t in decoder.values() if getattr(t, "special", False) and t.content]
    checked = []
    for message in messages:
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str) and any(c in reasoning for c in controls):
            logger.warning("an earlier turn's reasoning holds control-token text; left out")
            message = {k: v for k, v in message.items() if k != "reasoning_content"}
        checked.append(message)
    return checked
