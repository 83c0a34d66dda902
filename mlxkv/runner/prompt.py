"""Turning what a user passes as a prompt into token ids, with clear errors for bad input.

Owns: the three prompt forms (text, token ids, chat messages) and their validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Message = dict[str, str]
Prompt = str | Sequence[int] | Sequence[Message]

CHAT_ROLES = ("system", "user", "assistant", "tool")


def encode_prompt(tokenizer: Any, prompt: Prompt, vocab_size: int) -> list[int]:
    """Token ids for a prompt.

    Args:
        tokenizer: mlx-lm's TokenizerWrapper.
        prompt: text; token ids; or chat messages, rendered with the tokenizer's chat template
            and a generation prompt.
        vocab_size: token ids must be below this.

    Raises:
        ValueError: an empty prompt, ids outside the vocabulary, malformed messages, or
            messages for a tokenizer without a chat template.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty; pass some text, token ids or chat messages")
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
    elif not isinstance(prompt, Sequence) or len(prompt) == 0:
        raise ValueError("prompt is empty; pass some text, token ids or chat messages")
    elif all(isinstance(m, dict) for m in prompt):
        tokens = _render_messages(tokenizer, prompt)
    elif all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        tokens = list(prompt)
    else:
        raise ValueError("prompt must be a string, a list of token ids, or a list of messages")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1}); "
            "encode the prompt with this model's tokenizer"
        )
    if not tokens:
        raise ValueError("prompt encodes to no tokens")
    return tokens


def _render_messages(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"message {i} has role {role!r}; use one of {', '.join(CHAT_ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} needs a string 'content'")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass a plain string")
    return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True))
