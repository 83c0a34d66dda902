"""The model's thinking, split out of its generated text as it streams, for every API.

Owns: `ThinkingSplitter` (streamed text in; `Thought`s and answer text out, at the model's
thinking tags: mlx-lm's `TokenizerWrapper.think_start` / `think_end`, such as Qwen3's and
DeepSeek-R1's `<think>` / `</think>`) and `prompt_ends_thinking` (whether the output begins
inside a thinking block). Does not own the API formats, nor the thinking switches
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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxkv.runner.text.stop_strings import partial_suffix_length

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Thought:
    """A piece of the model's thinking."""

    text: str


class ThinkingSplitter:
    """Splits a stream of text into `Thought`s and answer text (`str`), in order.

    Args:
        start, end: the model's thinking tags.
        thinking: whether the text begins inside a thought (`prompt_ends_thinking`).
        exits: markers that close a thought and stay in the answer (the tool-call start).
    """

    def __init__(self, start: str, end: str, *, thinking: bool, exits: Sequence[str] = ()):
        self._start = start
        self._end = end
        self._exits = tuple(marker for marker in exits if marker)
        self._thinking = thinking
        self._trim = thinking  # drop the whitespace that opens the next section
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


def prompt_ends_thinking(
    runner: Any, prompt: Sequence[dict[str, Any]] | str | list[int], switches: dict | None
) -> bool:
    """Whether the output of `prompt` begins inside a thought: the prompt opens a thinking
    block it does not close (templates that end the generation prompt with the start tag, as
    DeepSeek-R1's and Qwen3's thinking-only ones do; mlx-lm's server reads it the same way).

    Chat messages are judged by the chat template's generation prompt, rendered for a
    one-message conversation with the same `switches` (the full prompt is not rendered a
    second time); text by its end, as Ollama does; token ids by their last tags.
    """
    tokenizer = runner.tokenizer
    if isinstance(prompt, str):
        return prompt.rstrip().endswith(tokenizer.think_start)
    tokens = prompt
    if prompt and isinstance(prompt[0], dict):
        try:
            # the shortest conversation a template renders a generation prompt for
            tokens = runner.encode([{"role": "user", "content": "?"}], switches=switches)
        except ValueError as error:  # a template that wants more than one user message
            logger.debug("thinking probe not rendered (%s); output read as the answer", error)
            return False
    return tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(tokens)


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
