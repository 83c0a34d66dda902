"""Control-token text a client sent, kept as text wherever the chat template writes it.

Owns `ControlText` (a tokenizer's control-token strings, their ids as plain text, and one
render's messages masked: `masked`, which content holds such text; the other message fields,
tool definitions and template variables with it behind placeholders) and `MaskedMessages`. Does
not own rendering (`chat.ChatTemplate`, `vision.VisionPrompts`), which puts a tainted
message's whole content behind a slot.

Terms:
  - tainted message: one whose content holds control-token text; the renders put its whole
    content behind a slot and tokenize it as plain text.
  - call placeholder: what stands, in a render, for one control-token string found inside a
    message's fields besides content (a tool call's name or arguments, keys and values at any
    depth; `name`, `tool_call_id`, thinking), a tool definition or a template variable. The
    template writes calls through `tojson`, escapes included, and may write a name twice (a
    tool result named after its call) or not at all, so the placeholder stands for the
    control string alone, not the whole value: each place the template wrote it becomes the
    string's plain-text ids, and the text around it stays as the template wrote it.
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxkv.runner.text.messages import Message
from mlxkv.runner.text.tokenizer_facts import control_tokens, plain_text_tokenizer


class ControlText:
    """The control-token strings of one tokenizer, and a copy of it that reads them as text.

    Args:
        tokenizer: mlx-lm's TokenizerWrapper or a Hugging Face tokenizer.
    """

    def __init__(self, tokenizer: Any):
        # mlx-lm's wrapper hands attributes it lacks to the Hugging Face tokenizer it wraps
        controls = sorted(control_tokens(tokenizer), key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, controls))) if controls else None
        # None also for a tokenizer without a `tokenizers` backend: such text is refused
        self.plain = plain_text_tokenizer(tokenizer) if controls else None

    def plain_ids(self, text: str) -> list[int]:
        """`text`'s ids, its control-token strings as plain text (`plain` must be set); by the
        batch call, which releases the GIL while it runs (`encode` held it: a long message
        stopped every other thread, the server's event loop too)."""
        return self.plain.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def found(self, text: Any) -> str | None:
        """The first control-token string in `text` (a str), or None."""
        if self.pattern is None or not isinstance(text, str):
            return None
        return match.group(0) if (match := self.pattern.search(text)) else None

    def masked(
        self,
        messages: Sequence[Message],
        *,
        enabled: bool,
        encode: Callable[[str], list[int]],
        known: Container[int] = (),
        template_args: dict[str, Any] | None = None,
    ) -> MaskedMessages:
        """`messages` and `template_args` as one render takes them: the control-token text
        of their tool calls, and of the tool definitions and template variables (vLLM's
        `chat_template_kwargs`) in `template_args`, behind call placeholders, which `encode`
        (rendered text to ids) then reads as plain text.

        Args:
            enabled: whether to mask at all (not the caller's `parse_control_tokens`).
            encode: the ids of text the template wrote, without placeholders.
            known: indices of known replies (their ids stand for them: never tainted).
            template_args: the other variables the render passes the template.

        Raises:
            ValueError: control-token text in calls, tools or template variables, and no
                tokenizer that keeps it as text.
        """
        args = dict(template_args or {})
        if not enabled or self.pattern is None:
            return MaskedMessages(list(messages), [], encode, enabled=False, template_args=args)
        tainted = [
            i for i, m in enumerate(messages) if i not in known and self.found(_field(m, "content"))
        ]
        nonce, keys = secrets.token_hex(8), {}  # control string -> its placeholder

        def placeholder(match: re.Match[str]) -> str:
            return keys.setdefault(match.group(0), f"mlxkv{nonce}control{len(keys)}end")

        out = []
        for i, message in enumerate(messages):
            # content is a slot of its own; every other field a template may write (tool
            # calls, `name`, `tool_call_id`, the thinking sent back) is masked in place
            fields = _besides_content(message)
            found = next(filter(None, map(self.found, _strings(fields))), None)
            if found is None:
                out.append(message)
                continue
            if self.plain is None:
                raise ValueError(
                    f"message {i}'s fields contain the control token text {found!r}, "
                    "which this model's tokenizer cannot keep as plain text; remove it"
                )
            out.append({**message, **_replaced(fields, self.pattern, placeholder)})
        args = self._masked_args(args, placeholder)
        if keys:
            strings = {key: control for control, key in keys.items()}
            encode = functools.partial(self._encode, strings, encode)
        return MaskedMessages(out, tainted, encode, enabled=True, template_args=args)

    def _masked_args(
        self, args: dict[str, Any], placeholder: Callable[[re.Match[str]], str]
    ) -> dict[str, Any]:
        """Tool definitions and template variables with their control-token text behind
        call placeholders: they reach the template as they are (tools through `tojson`, which
        leaves `<|...|>` as it is), so a tool description forged a system turn."""
        found = next(filter(None, map(self.found, _strings(args))), None)
        if found is None:
            return args
        if self.plain is None:
            raise ValueError(
                f"the tools or template variables contain the control token text {found!r}, "
                "which this model's tokenizer cannot keep as plain text; remove it"
            )
        return _replaced(args, self.pattern, placeholder)

    def _encode(
        self, strings: dict[str, str], encode: Callable[[str], list[int]], text: str
    ) -> list[int]:
        """The ids of rendered `text`: `encode` between placeholders, each placeholder (a key
        of `strings`) the plain-text ids of its control string, wherever the template wrote
        it."""
        pieces = re.split(f"({'|'.join(strings)})", text)
        ids = list(encode(pieces[0]))
        for key, piece in zip(pieces[1::2], pieces[2::2], strict=True):
            ids += self.plain_ids(strings[key])
            ids += encode(piece)
        return ids


@dataclass(frozen=True)
class MaskedMessages:
    """One render's messages, masked (`ControlText.masked`).

    Attributes:
        messages: the messages, their tool calls' control-token text behind placeholders.
        tainted: indices of the messages whose (string) content holds control-token text,
            which the render puts behind a slot and tokenizes whole as plain text.
        encode: text the template wrote to ids, each placeholder as its plain text.
        enabled: whether control-token text is masked (not `parse_control_tokens`).
        template_args: the render's other template variables (tools, switches), their
            control-token text behind placeholders; none by default.
    """

    messages: list[Message]
    tainted: list[int]
    encode: Callable[[str], list[int]]
    enabled: bool
    template_args: dict[str, Any] = field(default_factory=dict)


def _replaced(value: Any, pattern: re.Pattern[str], by: Callable[[re.Match[str]], str]) -> Any:
    """`value` with every match of `pattern` in its strings (dict keys included, at any
    depth) replaced `by` what it gives; lists for tuples."""
    if isinstance(value, str):
        return pattern.sub(by, value)
    if isinstance(value, dict):
        return {_replaced(k, pattern, by): _replaced(v, pattern, by) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_replaced(v, pattern, by) for v in value]
    return value


def _besides_content(message: Any) -> dict[str, Any]:
    """A message's fields other than its content ({} for a message not yet checked to be a
    dict)."""
    return {k: v for k, v in message.items() if k != "content"} if isinstance(message, dict) else {}


def _field(message: Any, name: str) -> Any:
    """`message[name]`, None where it has none (a message not yet checked to be a dict)."""
    return message.get(name) if isinstance(message, dict) else None


def _strings(value: Any) -> list[str]:
    """Every string in `value` (dict keys included), at any depth."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []
