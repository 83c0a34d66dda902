"""Where a prompt's parts end in its token ids: the landmarks a request keeps and checkpoints.

Owns `Landmarks` (the system messages' end, the generation prompt's start, a continued reply's
start) and `LandmarkFinder`, which finds them by rendering the chat again (without the
generation prompt; the system messages alone, kept by their input for the next turn) and
comparing with the prompt's ids. Does not own rendering (`chat`) nor the prompt forms
(`prompt`).
"""

from __future__ import annotations

import pickle
import secrets
from dataclasses import dataclass
from typing import Any

from mlxkv.cache.prefix import common_prefix_lengths
from mlxkv.runner.text.chat import ChatTemplate
from mlxkv.runner.text.messages import Message, Prompt, is_messages, leading_system_messages
from mlxkv.runner.text.replies import ReplyStart
from mlxkv.runner.text.segments import KeptIds

# Bytes of the system-alone renders' keys kept (`LandmarkFinder.find`): an agent's system
# prompt and tools are 20-90 KB a key, so a few dozen agents'; their ids as Python lists take
# about 10 bytes per key byte besides (measured 9.5), so at most about 20 MiB in all.
MAX_SYSTEM_RENDER_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class Landmarks:
    """Where a prompt's parts end in its token ids.

    Attributes:
        chat: the prompt is chat messages.
        system: the system messages a chat starts with (empty: none, or not a chat).
        system_tokens: the leading tokens that hold `system` (0 when empty or not asked for).
        header_tokens: tokens of the chat template's generation prompt at the end (at least
            1; 1 for text and token prompts).
        reply_start: where a chat continues its last message, that message's text and ids
            (`chat.RenderedChat`); None: not continued.
    """

    chat: bool
    system: list[Message]
    system_tokens: int
    header_tokens: int
    reply_start: ReplyStart | None = None


class LandmarkFinder:
    """Finds the landmarks of prompts rendered by one `ChatTemplate`; thread-safe (the system
    renders it keeps are shared under `KeptIds`' lock)."""

    def __init__(self, chat: ChatTemplate):
        self._chat = chat
        tokenizer = chat.tokenizer
        # The system messages rendered alone, by their exact input, for a template that
        # renders the same text for the same input (not one that reads the clock, nor mlx-lm's
        # custom Python renderers): agents send the same system prompt and tools every turn.
        self._system_renders = (
            KeptIds(None, MAX_SYSTEM_RENDER_BYTES)
            if chat.template_variables
            and "strftime_now" not in chat.template_variables
            and getattr(tokenizer, "_chat_template", None) is None
            else None
        )

    def find(
        self, prompt: Prompt, tokens: list[int], *, system_tokens: bool, **template: Any
    ) -> Landmarks:
        """Where the parts of `prompt` (encoded as `tokens` by `PromptEncoder.encode` with the
        same `template` arguments) end: the system messages (rendered alone only if
        `system_tokens`) and the generation prompt, where the next turn re-renders from (so
        where a checkpoint is most useful); where a continued last message's reply starts."""
        if not is_messages(prompt):
            return Landmarks(chat=False, system=[], system_tokens=0, header_tokens=1)
        system = leading_system_messages(prompt)
        whole = self._chat.render_prompt(prompt, add_generation_prompt=False, **template)
        rendered = [whole.tokens]
        if system and system_tokens:
            rendered.append(self._system_alone(system, template))
        ends = common_prefix_lengths(tokens, rendered)
        return Landmarks(
            chat=True,
            system=system,
            system_tokens=ends[1] if len(ends) > 1 else 0,
            header_tokens=max(1, len(tokens) - ends[0]),
            reply_start=whole.reply_start,
        )

    def _system_alone(self, system: list[Message], template: dict[str, Any]) -> list[int]:
        """The ids of the system messages rendered alone (kept ones: not to be changed)."""

        def render() -> list[int]:
            try:
                return self._chat.render(system, add_generation_prompt=False, **template)
            except ValueError:  # a template that wants a user message (Qwen3.5's)
                # then with a placeholder one: the prompt's ids share the system turn with
                # it and the next turn's header, a few tokens more kept at a shift
                user = {"role": "user", "content": f"mlxkv{secrets.token_hex(8)}"}
                return self._chat.render([*system, user], add_generation_prompt=False, **template)

        if self._system_renders is None:
            return render()
        # Everything the render reads but the replies' ids (no system message takes them);
        # pickled, order and types as given. Anything pickle refuses is rendered each time.
        switches = self._chat.template_switches(template.get("switches"))
        what = (system, template.get("tools"), switches, template.get("parse_control_tokens"))
        try:
            key = pickle.dumps(what, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError, ValueError, RecursionError):
            return render()
        return self._system_renders.kept(key, render)
