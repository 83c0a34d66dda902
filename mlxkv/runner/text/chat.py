"""A chat's messages through the model's chat template, to token ids.

Owns: the checks on chat messages, the switches a template reads (`template_switches`), and
the one render path (`ChatTemplate.render_prompt`): content masked so that it is only ever
text, replies sent back as the ids the model generated for them (`text.replies`), and a
continued last message, whose ids end where its reply starts (`RenderedChat`). Does not own
the other prompt forms (text, token ids: `prompt`), nor where a render's parts end
(`landmarks`), nor images (`vision`, which shares the checks and errors here).

Terms:
  - control token: a special added token of the tokenizer (`<|im_start|>`, `<|im_end|>`, ...).
    The chat template's own markers are control tokens; the same strings inside a message's
    content or tool calls are tokenized as plain text (`controls`), so a client cannot forge a
    system turn by writing `<|im_end|>\\n<|im_start|>system\\n...` in a user message.
    `parse_control_tokens=True` is the opt-out for callers that pass pre-rendered control
    tokens on purpose.
  - lone surrogates (from JSON escapes such as "\\ud800", or undecodable bytes on a command
    line) cannot be encoded as UTF-8; they become U+FFFD instead of failing in the tokenizer.
  - a continued message: the last assistant message left open (`CONTINUE_FINAL`), the reply
    its rest (Anthropic's prefill).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from mlxkv.runner.text.controls import ControlText, MaskedMessages
from mlxkv.runner.text.messages import Message, Tools, checked_tools, fold_system_reminders
from mlxkv.runner.text.replies import (
    ReplyChoice,
    ReplyIds,
    ReplyStart,
    before_reply,
    check_calls_apart,
    continued_ids,
    generation_prompt_of,
    known_reply,
    masked_reply,
    reply_context,
    slot_texts,
    without_call_replies,
)
from mlxkv.runner.text.segments import KeptIds, SegmentEncoder
from mlxkv.runner.text.tokenizer_facts import template_variables

CHAT_ROLES = ("system", "user", "assistant", "tool")
_SURROGATES = re.compile("[\ud800-\udfff]")
TEMPLATE_REFUSED = "the model's chat template refused the messages: {}"
# The switch (Hugging Face's and vLLM's name) that leaves a last assistant message open: the
# reply continues its text (Anthropic's prefill, Ollama's last assistant message).
CONTINUE_FINAL = "continue_final_message"
NOT_CONTINUED = (
    "this model's chat template does not write the last assistant message as given, so the "
    "reply cannot continue it; end the conversation with a user message instead"
)


@dataclass(frozen=True)
class RenderedChat:
    """A chat's token ids, and where they continue its last message (`CONTINUE_FINAL`), the
    start of its reply (`replies.ReplyStart`): the reply memory keeps the reply with it."""

    tokens: list[int]
    reply_start: ReplyStart | None = None


class ChatTemplate:
    """Chat messages to token ids through one tokenizer's (mlx-lm's TokenizerWrapper) chat
    template.

    Thread-safe: it keeps no per-call state (the segments' ids it keeps for later turns are
    shared under a lock), and the plain-text tokenizer is a separate copy of the model's,
    never switched back and forth.
    """

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.controls = ControlText(tokenizer)
        # Rendered text to ids, segments seen in an earlier turn taking their ids from then;
        # so does content tokenized as plain text (an agent's replies sent back each turn).
        self._segments = SegmentEncoder(tokenizer)
        self._plain_ids = KeptIds(self.controls.plain_ids)
        # Variables the chat template reads: only those are passed as switches.
        self.template_variables = template_variables(getattr(tokenizer, "chat_template", None))

    def template_switches(self, switches: dict[str, Any] | None) -> dict[str, Any]:
        """The entries of `switches` (`enable_thinking`, `reasoning_effort`, ... as vLLM's
        `chat_template_kwargs`) that this chat template reads; the others, and the arguments
        rendering sets itself, are dropped, so other templates render as before.
        `enable_thinking` always goes through: mlx-lm's wrapper passes it to every template
        anyway (its default: whether the vocabulary has thinking tokens), under the name a
        custom renderer takes."""
        if switches is not None and not isinstance(switches, dict):
            raise ValueError(f"template switches must be a dict, got {type(switches).__name__}")
        return {
            key: value
            for key, value in (switches or {}).items()
            if key in self.template_variables | {"enable_thinking"} and key not in _RENDER_ARGUMENTS
        }

    def render(self, messages: Sequence[Message], **options: Any) -> list[int]:
        """`render_prompt`'s token ids."""
        return self.render_prompt(messages, **options).tokens

    def render_prompt(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        parse_control_tokens: bool = False,
        tools: Tools | None = None,
        switches: dict[str, Any] | None = None,
        replies: ReplyIds | None = None,
    ) -> RenderedChat:
        """Token ids of chat messages (and tools, and the `switches` the template reads)
        through the chat template, with the start of the reply of a continued last message
        (`RenderedChat`); content stays text, except an assistant message whose content
        `replies` knows, which takes the ids the model generated for it (so the prompt is what
        the cache holds). A template that refuses system messages after the first turn
        (clients such as Claude Code send them as reminders) gets them folded into a user
        message instead.

        Raises:
            ValueError: malformed messages or tools, no chat template, a template that refuses
                the messages, or content holding control-token text that the template
                rewrites (so it cannot be located and kept as text).
        """
        messages = _checked_messages(messages)
        continued = continues_final(messages, switches)  # its text goes on: no turn after it
        template_args: dict[str, Any] = {
            **self.template_switches(switches),
            "add_generation_prompt": add_generation_prompt and not continued,
        }
        if tools:
            template_args["tools"] = checked_tools(tools)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass a plain string")
        try:
            return self._render(messages, parse_control_tokens, template_args, replies, continued)
        except TemplateError as error:
            folded = fold_system_reminders(messages)
            if folded == messages:
                raise ValueError(TEMPLATE_REFUSED.format(error)) from None
        try:  # a template that wants its system message first (Gemma, Mistral)
            return self._render(folded, parse_control_tokens, template_args, replies, continued)
        except TemplateError as error:
            raise ValueError(TEMPLATE_REFUSED.format(error)) from None

    def _render(
        self,
        messages: list[Message],
        parse_control_tokens: bool,
        template_args: dict[str, Any],
        replies: ReplyIds | None,
        continued: bool = False,
    ) -> RenderedChat:
        known = {
            i: ids
            for i, m in enumerate(messages)
            if (ids := self.reply_ids(m, replies)) is not None
        }
        # a client's control-token text stays text: in content (the whole content as plain
        # text) and in tool calls (a known reply's calls are its ids, masked or not)
        masked = self.controls.masked(
            messages,
            enabled=not parse_control_tokens,
            encode=self._segments.encode,
            known=known,
            template_args=template_args,
        )
        args = masked.template_args  # tools and switches, their control-token text masked
        if known:
            try:
                check_calls_apart(self.tokenizer, args, masked.messages, known)
                return self._render_in_pieces(masked, known, args, continued)
            except ReplyRewritten:  # the template changed it: the reply renders as text
                pass
            except TemplateError:  # a call reply refused without its calls (a tool message
                if replies is None or not any(messages[i].get("tool_calls") for i in known):
                    raise  # must follow calls), or other text written from them (`CallsApart`):
                text_replies = without_call_replies(replies)  # from the template; text: ids
                return self._render(
                    messages, parse_control_tokens, template_args, text_replies, continued
                )
        if not masked.tainted and not continued:
            text = self.tokenizer.apply_chat_template(masked.messages, tokenize=False, **args)
            return RenderedChat(masked.encode(text))
        return self._render_in_pieces(masked, {}, args, continued)

    def reply_ids(self, message: Message, replies: ReplyIds | None) -> Sequence[int] | None:
        """The ids the model generated for `message`, an assistant message `replies` knows
        (by `reply_keys`: its text, or its text and tool calls); None where it renders from
        the template: not such a message, not known, or generated by a model of another
        vocabulary. Text prompts and prompts with images (`vision.VisionPrompts`) both ask
        here; either renders a known one as `masked_reply`."""
        if replies is None or message.get("role") != "assistant":
            return None
        ids = known_reply(message, replies)
        return ids if ids is not None and self._fits(ids) else None

    def _fits(self, ids: Sequence[int]) -> bool:
        return not ids or (min(ids) >= 0 and max(ids) < self.vocab_size)

    def _render_in_pieces(
        self,
        prepared: MaskedMessages,
        known: dict[int, Sequence[int]],
        template_args: dict[str, Any],
        continued: bool = False,
    ) -> RenderedChat:
        """Template text with control tokens parsed; tainted messages' content as plain text,
        known replies' content as their ids, control-token text in calls as plain text; with
        `continued`, the ids end with the last message's content (what the template writes
        after it, its end of turn, is left out), the start of the reply.

        The template renders a random placeholder in place of each such content, so the
        content's place is where the template put it, never an earlier occurrence of the same
        text (content that repeats the template's own markers would otherwise turn them into
        text and itself into markers).

        Raises:
            ReplyRewritten: the template did not render a known reply's placeholder once, as
                given (it trims or rewrites content).
        """
        messages = prepared.messages
        last = len(messages) - 1
        slots = slot_texts(sorted({*prepared.tainted, *known, *([last] if continued else [])}))
        masked = [{**m, "content": slots.get(i, m["content"])} for i, m in enumerate(messages)]
        masked = [masked_reply(m, slots[i]) if i in known else m for i, m in enumerate(masked)]
        text = self.tokenizer.apply_chat_template(masked, tokenize=False, **template_args)
        ids: list[int] = []
        cursor, reply_start = 0, None
        opened = generation_prompt_of(self.tokenizer, template_args, "Hi")
        for i, slot in slots.items():
            start = text.find(slot, cursor)
            tainted = i in prepared.tainted
            if start < 0 or text.count(slot) != 1 or (tainted and not self.controls.plain):
                if i in known:
                    raise ReplyRewritten
                if not tainted:  # the message continued: the template does not write it
                    raise ValueError(NOT_CONTINUED)
                found = self.controls.found(messages[i]["content"])
                raise ValueError(
                    f"message {i} contains the control token text {found!r}, which this "
                    "model's chat template or tokenizer cannot keep as plain text; remove it "
                    "from the message"
                )
            head, content = text[cursor:start], messages[i]["content"]
            if i in known:
                own, head = self._own_reply(known[i], ids, head, content, prepared.encode, opened)
            if i in known or tainted:
                own = own if i in known else self._plain_ids(content)
                ids += prepared.encode(head) + own
                reply_start = ReplyStart(content, own) if continued and i == last else None
            else:  # the continued text, with the template's before it: as Hugging Face's cut
                decode = self.tokenizer.decode
                piece, reply_start = continued_ids(prepared.encode, head, content, decode, opened)
                ids += piece
            cursor = start + len(slot)
        ids += [] if continued else prepared.encode(text[cursor:])  # a continued turn: no end
        return RenderedChat(ids, reply_start)

    def _own_reply(
        self,
        reply: Sequence[int],
        ids: list[int],
        head: str,
        content: str,
        encode: Callable[[str], list[int]],
        opened: Callable[[], str | None],
    ) -> tuple[list[int], str]:
        """The ids of a known reply after `ids` and the template's `head` (`before_reply`), and
        that head: of several replies of its text with other ids (`ReplyChoice`), the one
        generated after them (each with its own head: a space its first id holds or not), so
        each conversation renders the ids its own cache holds; else the newest."""
        decode = self.tokenizer.decode
        if isinstance(reply, ReplyChoice) and reply.differ:
            contexts: dict[str, str] = {}  # by head: at most two (a space cut or not)
            for context, own in reversed(reply.by_context.items()):  # the newest first
                cut = before_reply(head, own, content, decode, opened)
                if cut not in contexts:
                    contexts[cut] = reply_context(ids + encode(cut))
                if context == contexts[cut]:
                    return own, cut
        return list(reply), before_reply(head, reply, content, decode, opened)


class ReplyRewritten(Exception):
    """A known reply's content was not rendered as given: it cannot take its ids."""


# What `render` passes itself; a switch of the same name is dropped.
_RENDER_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize"})


def _checked_messages(messages: Sequence[Message]) -> list[Message]:
    """`messages` as a list, each a dict of a chat role with text content (`valid_text`)."""
    checked = []
    for i, message in enumerate(messages):
        check_message(i, message, str)
        checked.append({**message, "content": valid_text(message["content"])})
    return checked


def check_message(i: int, message: Any, content_types: type | tuple[type, ...]) -> None:
    """Raises ValueError unless message `i` is a dict of a chat role whose content is one of
    `content_types` (a str; with images, a list of parts too). Prompts with and without
    images check their messages here alike."""
    if not isinstance(message, dict):
        raise ValueError(f"message {i} must be a dict with 'role' and 'content'")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"message {i} has role {role!r}; use one of {', '.join(CHAT_ROLES)}")
    content = message.get("content")
    if not isinstance(content, content_types):
        raise ValueError(
            f"message {i} needs a string 'content' or a list of text parts "
            "({'type': 'text', 'text': ...}; images need a vision model), got "
            f"{type(content).__name__}"
        )


def valid_text(text: str) -> str:
    """`text` with lone surrogates replaced; checked by encoding (6x the regex's speed on
    20k characters), the regex only where there is one."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATES.sub("\ufffd", text)
    return text


def continues_final(messages: Sequence[Message], switches: dict[str, Any] | None) -> bool:
    """Whether `switches` ask the render to continue the last message: an assistant message
    with text content and no tool calls (anything else renders as a closed turn)."""
    if not (switches or {}).get(CONTINUE_FINAL) or not messages:
        return False
    last = messages[-1]
    plain = isinstance(text := last.get("content"), str) and bool(text)
    return plain and last.get("role") == "assistant" and not last.get("tool_calls")
