"""Turning what a user passes as a prompt into token ids, with clear errors for bad input.

Owns: the three prompt forms (`messages.Prompt`: text, token ids, chat messages), their
validation, and the tokenizer's pieces a Runner's requests share: the chat template (`chat`:
chat messages rendered so that message content is only ever text) and the landmarks of its
renders (`landmarks`). A plain string prompt is taken as already rendered: its control-token
strings are parsed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxkv.runner.text.chat import ChatTemplate, valid_text
from mlxkv.runner.text.landmarks import LandmarkFinder
from mlxkv.runner.text.messages import Prompt, Tools, is_messages, is_token_ids
from mlxkv.runner.text.replies import ReplyIds
from mlxkv.runner.text.tokenizer_facts import largest_id

_ACCEPTED = (
    "a str, a list of token ids (int) or a list of chat messages (dicts with 'role' and 'content')"
)


class PromptEncoder:
    """Prompts to token ids for one tokenizer (mlx-lm's TokenizerWrapper).

    Attributes:
        chat: renders chat messages (`chat.ChatTemplate`).
        landmarks: finds where a chat prompt's parts end (`landmarks.LandmarkFinder`).

    Thread-safe, as its parts are.
    """

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.chat = ChatTemplate(tokenizer, vocab_size)
        self.landmarks = LandmarkFinder(self.chat)
        # Every id the tokenizer can give is in the model's vocabulary: its output needs no
        # check (a min and a max over a 15k-token prompt: 0.7 ms of a cached turn here).
        self._ids_fit = largest_id(tokenizer) < vocab_size

    def encode(
        self,
        prompt: Prompt,
        *,
        parse_control_tokens: bool = False,
        tools: Tools | None = None,
        switches: dict[str, Any] | None = None,
        replies: ReplyIds | None = None,
    ) -> list[int]:
        """Token ids for a prompt.

        Args:
            prompt: text (taken as already rendered); token ids; or chat messages, rendered
                with the chat template and a generation prompt.
            parse_control_tokens: let control-token strings inside message content and tool
                calls become control tokens (only for messages you wrote yourself).
            tools: function definitions (OpenAI's `{"type": "function", "function": {...}}`
                form) handed to the chat template; chat messages only.
            switches: chat-template variables such as `enable_thinking`; only those the
                template reads are passed (`template_switches`); chat messages only.
            replies: the ids of a reply generated here, by its text (`replies.ReplyTokens`):
                an assistant message whose content is one takes those ids.

        Raises:
            ValueError: a prompt of another type, an empty prompt, ids outside the vocabulary,
                malformed messages or tools, or messages for a tokenizer without a chat
                template.
        """
        if tools is not None and not is_messages(prompt):
            raise ValueError(
                "tools need a prompt of chat messages; a text or token prompt is already rendered"
            )
        if isinstance(prompt, str):
            return self._checked(self._encode_text(prompt), rendered=True)
        elif isinstance(prompt, bytes | bytearray | memoryview):
            raise ValueError("prompt is bytes; decode it to a str first (prompt.decode('utf-8'))")
        elif not isinstance(prompt, Sequence):
            hint = (
                " (for an array of token ids, pass array.tolist())"
                if hasattr(prompt, "tolist")
                else ""
            )
            raise ValueError(f"prompt must be {_ACCEPTED}; got {type(prompt).__name__}{hint}")
        elif len(prompt) == 0:
            raise ValueError(f"prompt is empty; pass {_ACCEPTED}")
        elif all(isinstance(m, dict) for m in prompt):
            tokens = self.chat.render(
                prompt,
                parse_control_tokens=parse_control_tokens,
                tools=tools,
                switches=switches,
                replies=replies,
            )
            return self._checked(tokens, rendered=True)
        elif is_token_ids(prompt):
            tokens = [int(t) for t in prompt]
        else:
            kinds = sorted({type(x).__name__ for x in prompt})
            raise ValueError(f"prompt must be {_ACCEPTED}; got a list of {', '.join(kinds)}")
        return self._checked(tokens)

    def _encode_text(self, prompt: str) -> list[int]:
        """A rendered prompt's ids, with a BOS token unless the text begins with one."""
        if not prompt:
            raise ValueError(f"prompt is empty; pass {_ACCEPTED}")
        text = valid_text(prompt)
        bos = self.tokenizer.bos_token
        add_bos = bos is None or not text.startswith(bos)
        return self.tokenizer.encode(text, add_special_tokens=add_bos)

    def _checked(self, tokens: Sequence[int], rendered: bool = False) -> list[int]:
        """`tokens` as a list, once each is in the vocabulary and there is at least one.
        `rendered`: a fresh list of the tokenizer's ids (and replies' that fit), checked only
        if the tokenizer has ids the model lacks."""
        if not tokens:
            raise ValueError("prompt encodes to no tokens")
        if rendered and self._ids_fit:
            return tokens
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:  # C speed; the scan only then
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1}); "
                "encode the prompt with this model's tokenizer"
            )
        return list(tokens)
