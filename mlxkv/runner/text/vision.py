"""Chat messages with images into a token record and the images' places.

Owns: recognizing image parts in messages (`has_images`), joining the text parts of a
prompt without images into strings (`with_text_content`), refusing images for a model without
vision, and `VisionPrompts`, which renders messages through the model's own chat template and
expands each image marker the template writes into the image's tokens, carrying its
placeholder id (`mlxkv.models.vision.placeholder_id`). Does not own decoding the images
(`mlxkv.models.images`) nor running them (`mlxkv.models.vision`).

Terms:
  - image part: `{"type": "image", "image": path | bytes | base64/data: URL | PIL.Image}` in a
    message's content list, beside `{"type": "text", "text": ...}` parts.
  - Control-token escaping: a text part holding control-token strings (a user typing
    `<|image_pad|>`) is tokenized as plain text, so only the template's own image markers
    become images (else the count of markers would no longer match the images); so is such
    text in a tool call (`text.controls`).
  - Reply sent back: an assistant message whose content the reply memory knows
    (`text.replies`) takes the ids the model generated (of several replies of its text, those
    generated after the record before it), as in a text prompt (`ChatTemplate.reply_ids`), so
    the next turn matches what the cache holds even where the reply's text encodes otherwise.
    The images' spans are found in the record after that substitution, so an image after the
    reply gets its place (and, from the record, its M-RoPE positions) in the ids actually fed.
    A reply holding the image token's id keeps it as text: only placeholders are images'
    tokens (`mlxkv.models.vision.ImagePrompt`). A reply with calls takes its ids only where
    the template writes nothing else from them (`replies.check_calls_apart`, as in text).
  - Continued message: a last assistant message with `CONTINUE_FINAL` (Anthropic's prefill)
    ends the render, cut right after its text as Hugging Face's `continue_final_message`
    cuts it, the reply its rest (as a text prompt's, `text.chat`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from mlxkv.errors import ImagesNotSupportedError
from mlxkv.models.images import decode_image
from mlxkv.models.vision import MAX_IMAGES_PER_PROMPT, ImageSpan, VisionSupport, placeholder_id
from mlxkv.models.vision_families import ProcessedImage
from mlxkv.runner.text.chat import (
    NOT_CONTINUED,
    TEMPLATE_REFUSED,
    ChatTemplate,
    ReplyRewritten,
    check_message,
    continues_final,
    valid_text,
)
from mlxkv.runner.text.controls import MaskedMessages
from mlxkv.runner.text.messages import Message, Tools, checked_tools, fold_system_reminders
from mlxkv.runner.text.replies import (
    ReplyChoice,
    ReplyIds,
    ReplyStart,
    before_reply,
    check_calls_apart,
    continued_ids,
    generation_prompt_of,
    masked_reply,
    reply_context,
    slot_text,
    without_call_replies,
)

# A user message's text part, for the generation prompt the template writes after one.
_HI = {"type": "text", "text": "Hi"}


@dataclass(frozen=True)
class ImageTokens:
    """A prompt with images, encoded.

    Attributes:
        tokens: the token record: text ids, and each image's placeholder id once per token.
        spans: the images' places, in order.
        reply_start: where the record continues its last message (`CONTINUE_FINAL`), that
            message's text and the ids it ends with, as a text prompt's (`chat.RenderedChat`);
            None: not continued, or the template wrote it otherwise.
    """

    tokens: list[int]
    spans: tuple[ImageSpan, ...]
    reply_start: ReplyStart | None = None


def has_images(prompt: Any) -> bool:
    """Whether `prompt` is chat messages with at least one image part."""
    return _chat(prompt) and any(
        isinstance(m, dict) and any(_is_image(part) for part in _parts(m.get("content")))
        for m in prompt
    )


def with_text_content(prompt: Any) -> Any:
    """`prompt` with each message's OpenAI-style text parts (`{"type": "text", "text": ...}`)
    joined into its content string, as the server joins them, so that a prompt, and the reply
    ids it sends back (`text.replies`), are the same whichever form a client sends; anything
    else as it is (the checks that follow say what is wrong). Messages without parts: the
    same object, no copy (nor a walk of a token-id prompt's items)."""
    if not _chat(prompt) or not any(_text_parts(m) for m in prompt):
        return prompt
    return [_as_text(m) for m in prompt]


def _as_text(message: Any) -> Any:
    """`message` with its text parts joined (`with_text_content`), else itself."""
    return {**message, "content": _joined(message["content"])} if _text_parts(message) else message


def _chat(prompt: Any) -> bool:
    """Whether `prompt` may be chat messages: a list whose first item is a dict (as
    `messages.is_messages`, here so that a request enters that module no more often). A list
    of token ids is answered from its first item, without a walk of its tens of thousands."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str | bytes)
        and bool(prompt)
        and isinstance(prompt[0], dict)
    )


def _text_parts(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list | tuple) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    )


def _joined(parts: Sequence[dict[str, Any]]) -> str:
    return "".join(part["text"] for part in parts)


class VisionPrompts:
    """Messages with images to `ImageTokens` for one model.

    Args:
        chat: the model's chat template (its tokenizer and control tokens).
        support: the model's vision support; None for a text-only model (every image refused).
        model_name: how errors name the model.
    """

    def __init__(self, chat: ChatTemplate, support: VisionSupport | None, model_name: str):
        self._chat = chat
        self._support = support
        self._model_name = model_name
        # The last prompt's images through the processor, by digest: a request renders its
        # prompt again (without the generation prompt; a cut's candidates), and the next turn
        # of a conversation holds the same images. Replaced whole by each encode (atomic).
        self._recent: dict[str, ProcessedImage] = {}

    def encode(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        parse_control_tokens: bool = False,
        tools: Tools | None = None,
        switches: dict[str, Any] | None = None,
        replies: ReplyIds | None = None,
    ) -> ImageTokens:
        """Renders `messages` and their images; an assistant message whose content `replies`
        knows takes its generated ids (`ChatTemplate.reply_ids`), unless the template does
        not render that content once, as given (then all render as text, as a text prompt's).

        Raises:
            ImagesNotSupportedError: a text-only model.
            ValueError: malformed parts; an image that cannot be decoded or
                is over a limit; more than `MAX_IMAGES_PER_PROMPT` images; a template that
                does not place one marker per image.
        """
        self._check_renders_images()
        asked = {"add_generation_prompt": add_generation_prompt, "tools": tools}
        asked |= {"parse_control_tokens": parse_control_tokens, "switches": switches}
        try:
            return self._encode(messages, replies, asked)
        except TemplateError as error:
            folded = fold_system_reminders(messages)  # as a text prompt's (`ChatTemplate`)
            if folded == list(messages):
                raise ValueError(TEMPLATE_REFUSED.format(error)) from None
        try:
            return self._encode(folded, replies, asked)
        except TemplateError as error:
            raise ValueError(TEMPLATE_REFUSED.format(error)) from None

    def _encode(
        self, messages: Sequence[Message], replies: ReplyIds | None, asked: dict[str, Any]
    ) -> ImageTokens:
        """One render of `messages` as they are, with the options `asked`: a template's refusal
        raises (TemplateError), for `encode` to fold the system reminders and try again."""
        switches, tools = asked["switches"], asked["tools"]
        last = valid_text(messages[-1]["content"]) if continues_final(messages, switches) else None
        args: dict[str, Any] = {
            **self._chat.template_switches(switches),
            "add_generation_prompt": asked["add_generation_prompt"] and last is None,
        }
        if tools:
            args["tools"] = checked_tools(tools)
        calls = self._masked_calls(messages, asked["parse_control_tokens"], args)
        args = calls.template_args  # tools and switches, their control-token text masked
        masked, images, slots, known = self._masked(messages, calls, replies)
        cut = None if last is None else _cut_after_last(masked)
        decoded = _decoded(images)
        try:
            text = self._chat.tokenizer.apply_chat_template(masked, tokenize=False, **args)
            sent = {i: _as_text(messages[i]) for i in known.values()}  # as `_masked` read them
            as_sent = [sent.get(i, m) for i, m in enumerate(masked)]
            check_calls_apart(self._chat.tokenizer, args, as_sent, sent)
        except TemplateError:
            # a call reply refused without its calls, or other text written from them
            # (`CallsApart`): it renders from the template (text replies: their ids)
            if replies is None or _num_with_calls(masked) == _num_with_calls(messages):
                raise
            return self._encode(messages, without_call_replies(replies), asked)
        text = text if cut is None else _cut_at(text, cut)
        processed = self._processed(decoded)
        try:
            replied = {slot: sent[i]["content"] for slot, i in known.items()}
            expansions = [p.text for p in processed]
            segments, start = self._ids(text, slots, replied, expansions, calls.encode, args, last)
        except ReplyRewritten:  # the template changed a reply: every reply renders as text
            return self._encode(messages, None, asked)
        return self._expanded(segments, decoded, processed, start)

    def _check_renders_images(self) -> None:
        if self._support is None:
            raise ImagesNotSupportedError(self._model_name)
        if not getattr(self._chat.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template, which images need")

    def _processed(self, decoded: list[Any]) -> list[ProcessedImage]:
        """The images through the model's processor; the last prompt's again from memory."""
        recent, process = self._recent, self._support.family.process
        processed = [recent.get(i.digest) or process(i.image) for i in decoded]
        self._recent = {i.digest: p for i, p in zip(decoded, processed, strict=True)}
        return processed

    def _masked_calls(
        self, messages: Sequence[Message], parse_control_tokens: bool, args: dict[str, Any]
    ) -> MaskedMessages:
        """`messages` and the template's other `args` with control-token text in their tool
        calls, tools and variables behind placeholders (`text.controls`), unless such text
        is to be parsed."""
        tokenizer = self._chat.tokenizer
        return self._chat.controls.masked(
            messages,
            enabled=not parse_control_tokens,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
            template_args=args,
        )

    def _masked(
        self, messages: Sequence[Message], calls: MaskedMessages, replies: ReplyIds | None
    ) -> tuple[list[Message], list[Any], dict[str, list[int]], dict[str, int]]:
        """Messages as the template takes them (image parts bare; tainted text and known
        replies behind a random slot; control-token text in calls behind `calls`'
        placeholders), the image sources in order, slot -> the ids it stands for (tainted
        text's plain ids, a reply's generated ids), and the replies' slots -> their messages'
        indices."""
        nonce, controls = secrets.token_hex(8), self._chat.controls
        masked, images, slots, known = [], [], {}, {}

        def text(value: Any, where: str) -> str:
            if not isinstance(value, str):
                raise ValueError(f"{where} needs a string text, got {type(value).__name__}")
            value = valid_text(value)
            if not calls.enabled or not controls.found(value):
                return value
            slot = slot_text(nonce, len(slots))
            slots[slot] = controls.plain_ids(value)
            return slot

        def reply(message: Message) -> Sequence[int] | None:  # sent back as text parts too
            return self._chat.reply_ids(_as_text(message), replies)

        for i, (message, rendered) in enumerate(zip(messages, calls.messages, strict=True)):
            check_message(i, message, (str, list, tuple))
            content = message.get("content")
            if (ids := reply(message)) is not None:  # its calls are in its ids
                slot = slot_text(nonce, len(slots))
                slots[slot] = ids
                known[slot] = i
                masked.append(masked_reply(message, slot))
                continue
            message = rendered
            if isinstance(content, str):
                masked.append({**message, "content": text(content, f"message {i}")})
                continue
            parts = []
            for j, part in enumerate(_parts(content)):
                where = f"message {i} part {j}"
                if _is_image(part):
                    images.append(part.get("image"))
                    parts.append({"type": "image"})
                elif isinstance(part, dict) and part.get("type") == "text":
                    parts.append({"type": "text", "text": text(part.get("text"), where)})
                else:
                    raise ValueError(f"{where} must be a text or image part: {_describe(part)}")
            masked.append({**message, "content": parts})
        return masked, images, slots, known

    def _ids(
        self,
        text: str,
        slots: dict[str, list[int]],
        replied: dict[str, Any],
        expansions: list[str],
        encode: Callable[[str], list[int]],
        template_args: dict[str, Any],
        continued: str | None,
    ) -> tuple[list[tuple[list[int], bool]], ReplyStart | None]:
        """The rendered text's ids in segments: (ids, from the template) pairs. Each image
        marker the template wrote is replaced, in the text, by its image's expansion (as the
        processor does), so the text around it tokenizes as in the model's own pipeline (by
        `encode`); each slot by the ids it stands for, a reply's (`replied`: its slot -> its
        content as sent) after the template's text less the space its ids hold and the
        generation prompt (with `template_args`) did not (`before_reply`). With the text of
        a `continued` last message (the text is cut after it), the reply start it ends with.

        Raises:
            ReplyRewritten: a reply's slot is not in the text once, as given."""
        segments, cursor, pending = [], 0, list(reversed(expansions))
        opened = generation_prompt_of(self._chat.tokenizer, template_args, [_HI])

        def expanded(piece: str) -> str:
            marker = self._support.family.marker
            pieces = piece.split(marker)
            if len(pieces) - 1 > len(pending):
                raise ValueError("the chat template wrote more image markers than images")
            return pieces[0] + "".join(pending.pop() + p for p in pieces[1:])

        for slot, ids in slots.items():
            start = text.find(slot, cursor)
            if slot in replied and (start < 0 or text.count(slot) != 1):
                raise ReplyRewritten
            if start < 0:
                raise ValueError("the chat template rewrote a message's text; it cannot be kept")
            head = text[cursor:start]
            if slot in replied:
                decode = self._chat.tokenizer.decode
                head = before_reply(head, ids, replied[slot], decode, opened)
            segments.append((encode(expanded(head)), True))
            segments.append((ids, False))
            cursor = start + len(slot)
        tail, reply_start = expanded(text[cursor:]), None
        if continued is not None and not tail and segments:  # the message is a slot: its ids
            reply_start = ReplyStart(continued, list(segments[-1][0]))
        if continued is not None and tail.endswith(continued):  # as a text prompt's
            decode = self._chat.tokenizer.decode
            head = tail[: len(tail) - len(continued)]
            ids, reply_start = continued_ids(encode, head, continued, decode, opened)
            segments.append((ids, True))
        else:
            segments.append((encode(tail), True))
        if pending:
            raise ValueError(
                f"the chat template placed {len(expansions) - len(pending)} image markers for "
                f"{len(expansions)} images"
            )
        return segments, reply_start

    def _expanded(
        self,
        segments: list[tuple[list[int], bool]],
        decoded: list[Any],
        processed: list[ProcessedImage],
        reply_start: ReplyStart | None,
    ) -> ImageTokens:
        """The token record: each image's feature tokens (the template's, in order, as many
        as its encoder gives rows) carry its placeholder id; the text between its runs stays."""
        image_token_id = self._support.image_token_id
        tokens: list[int] = []
        runs: list[list[tuple[int, int]]] = [[] for _ in decoded]
        image, left = 0, processed[0].num_features if processed else 0
        for ids, from_template in segments:
            if isinstance(ids, ReplyChoice) and ids.differ:  # its conversation's: after the
                ids = ids.choose(reply_context(tokens))  # record so far, images as placeholders
            for token in ids:
                if not (from_template and token == image_token_id):
                    tokens.append(token)
                    continue
                if image == len(decoded):
                    raise ValueError("the chat template wrote more image tokens than images")
                image_runs = runs[image]
                if image_runs and sum(image_runs[-1]) == len(tokens):
                    image_runs[-1] = (image_runs[-1][0], image_runs[-1][1] + 1)
                else:
                    image_runs.append((len(tokens), 1))
                tokens.append(placeholder_id(decoded[image].digest))
                left -= 1
                if left == 0:
                    image += 1
                    left = processed[image].num_features if image < len(processed) else 0
        if image != len(decoded):
            raise ValueError(f"the chat template placed {image} images' tokens for {len(decoded)}")
        spans = []
        for image_runs, source, done in zip(runs, decoded, processed, strict=True):
            start, end = image_runs[0][0], sum(image_runs[-1])
            at = {"start": start, "num_tokens": end - start, "runs": tuple(image_runs)}
            spans.append(ImageSpan(**at, digest=source.digest, processed=done))
        return ImageTokens(tokens, tuple(spans), reply_start)


def _decoded(images: list[Any]) -> list[Any]:
    """The prompt's images decoded (`decode_image`), at most `MAX_IMAGES_PER_PROMPT`."""
    if len(images) > MAX_IMAGES_PER_PROMPT:
        raise ValueError(
            f"the prompt holds {len(images)} images; this model takes at most "
            f"{MAX_IMAGES_PER_PROMPT} per prompt"
        )
    return [decode_image(source) for source in images]


def _cut_after_last(masked: list[Message]) -> str:
    """Marks the end of the last message's content (in place) with a random placeholder, for
    a render that continues it (`_cut_at`)."""
    cut = slot_text(secrets.token_hex(8), 0)
    masked[-1] = {**masked[-1], "content": masked[-1]["content"] + cut}
    return cut


def _cut_at(text: str, cut: str) -> str:
    """The rendered `text` up to the placeholder `cut`: it ends with the continued message's
    content, which tokenizes with the template's text before it, as in Hugging Face's
    `continue_final_message` cut (what the template writes after it is left out)."""
    if text.count(cut) != 1:
        raise ValueError(NOT_CONTINUED)
    return text[: text.index(cut)]


def _parts(content: Any) -> list[Any]:
    return list(content) if isinstance(content, list | tuple) else []


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def _describe(part: Any) -> str:
    return f"type {part.get('type')!r}" if isinstance(part, dict) else type(part).__name__


def _num_with_calls(messages: Sequence[Message]) -> int:
    """How many of `messages` have tool calls (fewer masked: a known call reply's are its ids)."""
    return sum(1 for m in messages if m.get("tool_calls"))
