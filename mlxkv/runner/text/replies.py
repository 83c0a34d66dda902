"""The token ids of recent replies, so that a reply sent back renders to what the cache holds.

A model's reply is a sequence of token ids; its text, encoded again, is often another sequence
(SmolLM2 wrote "SmolLAM" as `S|m|ol|L|AM`, which encodes as `Sm|ol|L|AM`). The next turn's
prompt would then differ from the cache at the reply's first such token, and everything after
it would be computed again. When an assistant message's content equals a reply generated
here, the prompt takes that reply's ids (`ChatTemplate.render`; with images,
`VisionPrompts.encode`, both through `ChatTemplate.reply_ids`); the rest of the prompt still
comes from the chat template (and the images from the model's processor), less a space the
template writes before a reply whose ids begin with it (`before_reply`).

Owns `ReplyTokens`: a bounded, thread-safe memory of replies by (isolation domain, text), one
per tokenizer (`replies_for`): every Runner of a loaded model in a process renders the same
messages to the same ids (a fresh Runner compared with a used one sees the same prompt). Two
replies of one text with other ids (a sampled tokenization that is not the tokenizer's own,
lone bytes decoding to U+FFFD) are both kept, each with what it was generated after (its
`reply_context`): a render gives each the ids its own conversation's cache holds (of a
`ReplyChoice`, the one generated after the ids rendered before it, with images too), so one
conversation's reply never changes how another's next turn renders. A
reply is remembered only when its text is exactly what its ids decode to: not one cut by a stop
string (its ids go past the text), nor a cancelled one. Keyed by the request's cache salt
digest, so one tenant's prompt never takes another's reply ids (its token count would tell).
With a disk tier, the replies are also kept on disk (`mlxkv.runner.disk.replies`, written
behind with their turns' blocks) and read back when a Runner starts (`ReplyTokens.restore`): a
restarted process, or a model loaded again, renders them as their ids too; a reply the memory
dropped is looked up among those records (`known_in`'s `stored`), so the process that
generated it renders it as a restarted one does.

A continued reply (the last assistant message left open, `prompt.CONTINUE_FINAL`: Anthropic's
prefill) comes back as one assistant message, the prefill and the reply's text together: it is
remembered by that text, with the ids the prompt ended with for the prefill (`ReplyStart`, as
the render tokenized them after the template's text) and then the generated ids, so the next
turn renders the whole message as the ids the cache holds.

A reply that called tools comes back as its text before the calls plus the parsed calls
(`tool_calls`), which the template renders in its own form (spacing, key order, escapes), not
as the model wrote them: the server, which parses the calls, has the Runner remember such a
reply by `call_reply_key` of what the client sends back instead of its text (`ReplyKey`,
`mlxkv.server.reply.turn.reply_keyer`; one slot, and one record on disk), and the whole
message then takes the reply's ids, calls included (`masked_reply`). Not a reply with a
thought: the template may drop or render it otherwise, as it does for a text reply.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import secrets
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from jinja2 import TemplateError

from mlxkv.runner.results import Completion
from mlxkv.runner.text.messages import Message

# Replies whose text matches nothing sent back only take memory: the newest are kept.
MAX_REPLIES = 256
# Replies of one text with other ids, each after its own context (`ReplyChoice`): the newest.
MAX_CHOICES = 4
MAX_REPLY_TOKENS = 1 << 20  # all remembered replies together: 4 MiB of uint32
_CALLS = "\0calls"  # how a call reply's key starts (`call_reply_key`): no text content does

# A request's known replies' ids by their text (`ReplyTokens.known_in(...).get`): a
# `ReplyChoice` where several replies have that text.
ReplyIds = Callable[[str], Sequence[int] | None]
# What a caller knows a finished reply by when it comes back, None for its text: the server,
# which parses its calls, a call reply's `call_reply_key` (run on the engine thread).
ReplyKey = Callable[[Completion], str | None]
# A disk tier's ids of the replies of (salt, text) by their contexts, None when it holds no
# record of one: where a reply the memory dropped is looked up (`DiskStore.stored_reply`).
StoredReplyIds = Callable[[str | None, str], dict[str | None, list[int]] | None]
_BY_TOKENIZER: weakref.WeakKeyDictionary[Any, ReplyTokens] = weakref.WeakKeyDictionary()
_BY_TOKENIZER_LOCK = threading.Lock()


def reply_context(prompt: Sequence[int]) -> str:
    """What a reply was generated after, in 32 hex digits: a digest of its prompt's ids (a
    continued reply's less its start), which a later render of its conversation renders
    before the reply again (`ReplyChoice.choose`)."""
    return hashlib.sha256(np.asarray(prompt, dtype="<u4").tobytes()).hexdigest()[:32]


class ReplyChoice(list):
    """The ids of the newest reply of a text, as a list (what a render without a choice takes),
    and the replies of that text by what each was generated after, oldest first: a render
    picks among them where their ids `differ` (else any is the same)."""

    def __init__(self, by_context: dict[str | None, list[int]]):
        super().__init__(list(by_context.values())[-1])
        self.by_context = by_context  # None: a record that did not say (older versions)
        self.differ = any(ids != self for ids in by_context.values())

    def choose(self, context: str) -> list[int]:
        """The ids of the reply generated after `context` (`reply_context`), else the newest's."""
        return self.by_context.get(context, list(self))


@dataclass(frozen=True)
class ReplyStart:
    """A continued last message's text and the ids its prompt ends with for it (`continued_ids`):
    the start of its reply, which the client sends back with the reply as one message."""

    text: str
    ids: list[int]


def continued_ids(
    encode: Callable[[str], list[int]],
    head: str,
    text: str,
    decode: Callable,
    generation_prompt: Callable[[], str | None],
) -> tuple[list[int], ReplyStart | None]:
    """The ids of `text` continued after the template's `head` (encoded together, as Hugging
    Face's cut is) and the reply start they end with: the ids after those of the text the next
    turn encodes before a known reply's ids (`head`, less the space those ids begin with where
    `before_reply` drops it: a template that writes `Assistant: {content}` after a generation
    prompt `Assistant:`, whose space the prefill's first word takes, ` The`). None where the
    joined ids do not begin with that text's: a token spans the template's text and the
    prefill otherwise, which no known reply's ids could reproduce."""
    ids = encode(head + text)
    for cut in dict.fromkeys((len(head), len(head.rstrip()))):  # as is; less its space
        head_ids = encode(head[:cut])
        own = ids[len(head_ids) :]
        kept = before_reply(head, own, text, decode, generation_prompt) if own else None
        if kept == head[:cut] and ids[: len(head_ids)] == head_ids:
            return ids, ReplyStart(text, own)
    return ids, None


def remember_reply(
    tokenizer: Any,
    completion: Completion,
    salt: str | None,
    key: str | None = None,
    ids: Sequence[int] | None = None,
    prompt: Sequence[int] = (),
) -> str | None:
    """Keeps the ids of a reply `tokenizer`'s model generated, in the domain `salt`, if its
    text is exactly theirs (at the end of a generation, before its last chunk is handed on:
    the next turn may follow at once), by its text or `key` (`call_reply_key`, or a continued
    reply's whole text), as its ids or `ids` (a continued reply's: its `ReplyStart`'s first),
    generated after `prompt`. Returns its context (`reply_context` of `prompt`) where it
    kept it (`is_rememberable`), else None."""
    if not is_rememberable(completion):  # a long prompt's digest spared
        return None
    context = reply_context(prompt)
    return context if replies_for(tokenizer).remember(completion, salt, key, ids, context) else None


def is_rememberable(completion: Completion) -> bool:
    """True when a reply's text is exactly what its ids decode to, so that ids may stand for
    it: not one cut by a stop string (its ids go past the text), nor a cancelled one."""
    return (
        bool(completion.text)
        and completion.stop_string is None
        and completion.finish_reason in ("stop", "length")
        and 0 < len(completion.tokens) <= MAX_REPLY_TOKENS
    )


def call_reply_key(
    content: str, calls: Iterable[tuple[str, Any]], ids: Sequence[str] | None = None
) -> str:
    """What a reply with tool calls is known by: its text before the calls and each call's
    (name, arguments), with `ids` the call ids the model wrote (one a call; None: it wrote
    none), in one canonical form (a NUL first: no text content takes it). Written ids are
    part of the reply's token ids: two replies differing only in them are two replies."""
    form: list[list[Any]] = [[name, arguments] for name, arguments in calls]
    if ids is not None:
        form = [[*call, call_id] for call, call_id in zip(form, ids, strict=True)]
    return _CALLS + json.dumps(
        [content, form], sort_keys=True, ensure_ascii=False, separators=(",", ":")
    )


def reply_keys(message: Any) -> list[str]:
    """What an assistant message sent back may be known by, the closest first: its text
    content; with tool calls, `call_reply_key` of its content, calls and their ids (a reply
    whose model wrote them), then without ids (a reply whose calls' ids were made here: the
    client may send them back or not, as Ollama's client does not). Empty: not an assistant
    message, no text, a call reply with a thought, or calls not in the chat template's form."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return []
    content = message.get("content")
    if not isinstance(content, str):
        return []
    calls = message.get("tool_calls")
    if not calls:
        return [content] if content else []
    if message.get("reasoning_content"):
        return []
    try:
        named = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    except (KeyError, TypeError):
        return []
    ids = [c.get("id") for c in calls]
    with_ids = [call_reply_key(content, named, ids)] if all(isinstance(i, str) for i in ids) else []
    return [*with_ids, call_reply_key(content, named)]


def known_reply(message: Any, replies: ReplyIds) -> Sequence[int] | None:
    """The ids `replies` knows `message` by, its closest key first (`reply_keys`)."""
    return next((ids for key in reply_keys(message) if (ids := replies(key)) is not None), None)


def without_call_replies(replies: ReplyIds) -> ReplyIds:
    """`replies` knowing text replies only: for a template that refuses a known call reply
    rendered without its calls (`masked_reply`; a tool message must follow calls), which then
    renders from the template while text replies keep their ids."""
    return lambda key: None if key.startswith(_CALLS) else replies(key)


class CallsApart(TemplateError):
    """The chat template writes more than a known call reply's calls from its `tool_calls`
    (`check_calls_apart`): its replies with calls render from the template."""


def check_calls_apart(
    tokenizer: Any, template_args: dict[str, Any], messages: list[Message], known: Iterable[int]
) -> None:
    """Checks that the known replies with calls among `messages` (indices `known`) take their
    ids without changing the rest of the prompt: the text `tokenizer`'s chat template writes
    for the messages as sent (with `template_args`) must be its text with each such reply
    masked (`masked_reply`, a slot for content and calls), any text in place of each slot:
    where the template writes the reply's content and calls, or the calls alone (Llama 3.1,
    Mistral and Hermes leave a call reply's content out), and nothing else from them. A
    template that writes a later message from the calls (a tool result named after its call,
    gpt-oss's; DeepSeek-V3 opening each round of tool results after a message with calls)
    fails it. Text prompts and prompts with images (`vision.VisionPrompts`) both check here.

    Raises:
        CallsApart: the texts differ elsewhere.
    """
    slots = slot_texts(i for i in known if messages[i].get("tool_calls"))
    if not slots:
        return
    without = [masked_reply(m, slots[i]) if i in slots else m for i, m in enumerate(messages)]
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False, **template_args)
    pieces = re.compile("|".join(map(re.escape, slots.values()))).split(render(without))
    if len(pieces) != len(slots) + 1 or not _in_order(render(messages), pieces):
        raise CallsApart("the chat template writes other text from a reply's tool calls")


def _in_order(text: str, pieces: list[str]) -> bool:
    """Whether `text` is `pieces` in order with any text between two (the first a prefix,
    the last a suffix). Each found at its first place from where the one before ended: that
    leaves the most room for the rest (with a regex of them the check took 154 ms on an
    agent's 258,000 characters and 40 call replies, mostly compiling; so, 5 ms with both
    renders)."""
    if not text.startswith(pieces[0]):
        return False
    end = len(pieces[0])
    for piece in pieces[1:-1]:
        if (found := text.find(piece, end)) < 0:
            return False
        end = found + len(piece)
    return len(text) - len(pieces[-1]) >= end and text.endswith(pieces[-1])


def slot_text(nonce: str, index: int) -> str:
    """The placeholder of slot `index` in a render marked with `nonce`: ended apart, so no
    slot's text holds another's (slot 1 in slot 11, seen in review rs11c)."""
    return f"mlxkv{nonce}slot{index}end"


def slot_texts(indices: Iterable[int]) -> dict[int, str]:
    """A placeholder for each of `indices` (`slot_text`), under one random nonce: content
    that the template renders in its place, found again in the text by it."""
    nonce = secrets.token_hex(8)
    return {i: slot_text(nonce, i) for i in indices}


def masked_reply(message: Message, slot: str) -> Message:
    """A known reply as the template renders it around `slot`, which its ids replace: its
    calls are part of those ids."""
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": slot}


def before_reply(
    head: str,
    ids: Sequence[int],
    content: Any,
    decode: Callable,
    generation_prompt: Callable[[], str | None],
) -> str:
    """`head`, the template's text before a known reply's `ids`, without the whitespace those
    ids begin with and its `content` does not, where `head` ends with it and the template's
    generation prompt (`generation_prompt()`, the text the reply was generated after; None:
    unknown) did not.

    A model that wrote ` than` after a generation prompt ending `Assistant:` returns the text
    `than` (the detokenizer drops a reply's leading space); a template that renders a reply
    sent back as `Assistant: {content}` (SmolVLM's, Idefics3's, Vicuna's) writes that space
    itself, and with the ids after it the prompt would read `Assistant:  than`: neither what
    the cache holds (the whole reply computed again every turn) nor the template's text. A
    generation prompt that ends `Assistant: ` itself held the space before the ids: kept."""
    first = decode(list(ids[:1]))
    lead = first[: len(first) - len(first.lstrip())]
    text = content if isinstance(content, str) else ""
    if lead and not text.startswith(lead) and head.endswith(lead):
        opened = generation_prompt()
        if opened is not None and not opened.endswith(lead):
            return head[: -len(lead)]
    return head


def generation_prompt_of(
    tokenizer: Any, template_args: dict[str, Any], user_content: Any
) -> Callable[[], str | None]:
    """A call giving, rendered once when first asked, the text `tokenizer`'s chat template
    writes for a generation prompt after one user message of `user_content` (a string, or
    parts for a template that reads them), with `template_args`'s switches and tools; None
    where the template refuses that message or renders it otherwise with the prompt."""

    @functools.cache
    def text() -> str | None:
        args = {k: v for k, v in template_args.items() if k != "add_generation_prompt"}
        user = [{"role": "user", "content": user_content}]
        try:
            closed = tokenizer.apply_chat_template(user, tokenize=False, **args)
            opened = tokenizer.apply_chat_template(
                user, tokenize=False, add_generation_prompt=True, **args
            )
        except TemplateError:
            return None
        return opened[len(closed) :] if opened.startswith(closed) else None

    return text


def replies_for(tokenizer: Any) -> ReplyTokens:
    """The reply memory of `tokenizer` (mlx-lm's wrapper of a loaded model), made on first use;
    it lives as long as the tokenizer."""
    with _BY_TOKENIZER_LOCK:
        found = _BY_TOKENIZER.get(tokenizer)
        if found is None:
            found = _BY_TOKENIZER[tokenizer] = ReplyTokens()
        return found


class ReplyTokens:
    """Recent replies' token ids by their text, newest kept (`MAX_REPLIES` texts, at most
    `MAX_CHOICES` replies a text, and at most `MAX_REPLY_TOKENS` in all), each reply by what
    it was generated after (`reply_context`; None: not known)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: OrderedDict[tuple[str | None, str], OrderedDict[str | None, np.ndarray]]
        self._ids = OrderedDict()
        self._num_tokens = 0

    def remember(
        self,
        completion: Completion,
        salt: str | None,
        key: str | None = None,
        ids: Sequence[int] | None = None,
        context: str | None = None,
    ) -> bool:
        """Keeps the ids of a finished reply (or `ids`), if its text is exactly theirs, by its
        text or `key`, after `context` (`remember_reply`); returns whether it did."""
        ids = completion.tokens if ids is None else ids
        if not is_rememberable(completion) or len(ids) > MAX_REPLY_TOKENS:
            return False
        with self._lock:
            self._keep(salt, completion.text if key is None else key, ids, context)
            self._trim()
        return True

    def restore(self, stored: Iterable[tuple[str | None, str, Sequence[int], str | None]]) -> None:
        """Takes the (salt, text, ids, context) of replies kept on disk
        (`DiskStore.stored_replies`) or by the model's previous load (`items`), oldest first,
        as older than every reply remembered here; a reply known here keeps its place."""
        with self._lock:
            for salt, text, ids, context in reversed(list(stored)):
                choices = self._ids.get((salt, text))
                if choices is None:
                    choices = self._ids[salt, text] = OrderedDict()
                    self._ids.move_to_end((salt, text), last=False)
                fits = 0 < len(ids) <= MAX_REPLY_TOKENS and len(choices) < MAX_CHOICES
                if context not in choices and fits:
                    choices[context] = np.asarray(ids, dtype=np.uint32)
                    choices.move_to_end(context, last=False)
                    self._num_tokens += len(ids)
                if not choices:
                    del self._ids[salt, text]
            self._trim()

    def items(self) -> list[tuple[str | None, str, list[int], str | None]]:
        """Every remembered reply as (salt, text, ids, context), oldest first (`restore`
        takes them)."""
        with self._lock:
            return [
                (salt, text, ids.tolist(), context)
                for (salt, text), choices in self._ids.items()
                for context, ids in choices.items()
            ]

    def _keep(self, salt: str | None, text: str, tokens: Sequence[int], context: str | None):
        choices = self._ids.pop((salt, text), None) or OrderedDict()
        old = choices.pop(context, None)
        self._num_tokens -= 0 if old is None else old.size
        choices[context] = np.asarray(tokens, dtype=np.uint32)
        self._num_tokens += len(tokens)
        while len(choices) > MAX_CHOICES or sum(map(np.size, choices.values())) > MAX_REPLY_TOKENS:
            self._num_tokens -= choices.popitem(last=False)[1].size  # the newest fits alone
        self._ids[salt, text] = choices

    def _trim(self) -> None:  # the oldest go first
        while len(self._ids) > MAX_REPLIES or self._num_tokens > MAX_REPLY_TOKENS:
            self._num_tokens -= sum(ids.size for ids in self._ids.popitem(last=False)[1].values())

    def known_in(
        self, prompt: Any, salt: str | None, stored: StoredReplyIds | None = None
    ) -> dict[str, ReplyChoice]:
        """The ids of the replies of `salt`'s domain that `prompt`'s assistant messages send
        back, by `reply_keys` (empty for a text or token prompt): looked up once a request, for
        the renders it makes. One this memory dropped is looked up in `stored` (a disk tier's
        records, kept as long as their chains) and remembered again: the process that
        generated it renders it as a restarted one, which reads the record, does."""
        if not isinstance(prompt, Sequence) or isinstance(prompt, str):
            return {}
        # a reply sent back as content parts renders from its parts' text
        texts = {key for m in prompt for key in reply_keys(m)}
        known: dict[str, ReplyChoice] = {}
        with self._lock:
            for text in texts:
                choices = self._ids.get((salt, text))
                if choices is not None:
                    self._ids.move_to_end((salt, text))
                    known[text] = ReplyChoice({c: ids.tolist() for c, ids in choices.items()})
        if stored is not None and (missing := texts - set(known)):
            found = {t: choices for t in missing if (choices := stored(salt, t))}
            with self._lock:
                for text, choices in found.items():
                    for context, ids in choices.items():
                        if 0 < len(ids) <= MAX_REPLY_TOKENS:
                            self._keep(salt, text, ids, context)
                self._trim()
            known.update((text, ReplyChoice(choices)) for text, choices in found.items())
        return known
