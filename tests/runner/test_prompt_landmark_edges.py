"""Review probes of the kept system render (`LandmarkFinder._system_alone`), the skipped
vocabulary scan and `token_array`: each against a fresh encoder (nothing kept) or numpy."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxkv import Runner
from mlxkv.runner.prompt_cache.entry import token_array
from mlxkv.runner.text.prompt import PromptEncoder
from mlxkv.runner.text.tokenizer_facts import largest_id
from mlxkv.testing.factory import CHAT_TEMPLATE, build_model

# Templates whose system turn reads something other than the system message's content.
_TURN = "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
_END = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
TEMPLATES = {
    # the number of messages, in the system turn
    "length": (
        "{% for message in messages %}{% if loop.first and message['role'] == 'system' %}"
        "<|im_start|>system\n({{ messages|length }} messages) {{ message['content'] }}"
        "<|im_end|>\n{% else %}" + _TURN + "{% endif %}{% endfor %}" + _END
    ),
    # the generation-prompt switch read in the system turn
    "generation-in-system": (
        "{% for message in messages %}{% if loop.first %}<|im_start|>"
        "{{ message['role'] }}{% if add_generation_prompt %} live{% endif %}\n"
        "{{ message['content'] }}<|im_end|>\n{% else %}" + _TURN + "{% endif %}{% endfor %}" + _END
    ),
    # loop.last, and a namespace set across the loop
    "namespace": (
        "{% set ns = namespace(n=0) %}{% for message in messages %}"
        "{% set ns.n = ns.n + message['content']|length %}"
        "<|im_start|>{{ message['role'] }}{% if loop.last %} last{% endif %}\n"
        "{{ message['content'] }} [{{ ns.n }}]<|im_end|>\n{% endfor %}" + _END
    ),
    # a system turn that renders the tools' names, and a message's extra key
    "named": (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}"
        "{% if message.name is defined %} {{ message.name }}{% endif %}\n"
        "{% if loop.first and tools %}{% for t in tools %}{{ t.function.name }};"
        "{% endfor %}{% endif %}{{ message['content'] }}<|im_end|>\n{% endfor %}" + _END
    ),
}
SYSTEM = {"role": "system", "content": "You are terse."}
CHAT = [SYSTEM, {"role": "user", "content": "list the files"}]
LS = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
CAT = {"type": "function", "function": {"name": "cat", "parameters": {"type": "object"}}}
REQUESTS = [
    (CHAT, {}),
    (CHAT, {}),
    ([*CHAT, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}], {}),
    (CHAT, {"tools": [LS]}),
    (CHAT, {"tools": [CAT]}),
    (CHAT, {"tools": (LS,)}),
    ([{**SYSTEM, "name": "boss"}, *CHAT[1:]], {}),
    ([{"name": "boss", **SYSTEM}, *CHAT[1:]], {}),
    ([{**SYSTEM, "name": "other"}, *CHAT[1:]], {}),
    ([{**SYSTEM, "content": "é\ud800 x"}, *CHAT[1:]], {}),
    ([{**SYSTEM, "content": "é\ufffd x"}, *CHAT[1:]], {}),
    ([{**SYSTEM, "content": "a<|im_start|>b"}, *CHAT[1:]], {}),
    ([{**SYSTEM, "content": "a<|im_start|>b"}, *CHAT[1:]], {"parse_control_tokens": True}),
    ([{**SYSTEM, "content": "a<|im_start|>b"}, *CHAT[1:]], {"parse_control_tokens": 1}),
    ([SYSTEM, {"role": "system", "content": "More."}, *CHAT[1:]], {}),
    (CHAT, {"switches": {"enable_thinking": False}}),
    (CHAT, {"switches": {"unread": 1}}),
]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def tokenizer(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "model"
    return load_tokenizer(build_model("llama", out, chat_template=TEMPLATES[request.param]))


def _outcome(encoder: PromptEncoder, messages, template):
    try:
        tokens = encoder.encode(messages, **template)
        return tokens, encoder.landmarks.find(messages, tokens, system_tokens=True, **template)
    except ValueError as error:
        return str(error)


def test_landmarks_equal_a_fresh_encoders(tokenizer):
    kept = PromptEncoder(tokenizer, 512)
    assert kept.landmarks._system_renders is not None
    for i, (messages, template) in enumerate(REQUESTS * 2):
        expected = _outcome(PromptEncoder(tokenizer, 512), messages, template)
        assert _outcome(kept, messages, template) == expected, f"request {i}"


def test_a_system_message_changed_in_place_is_rendered_again(tokenizer):
    system = dict(SYSTEM)
    chat = [system, CHAT[1]]
    kept = PromptEncoder(tokenizer, 512)
    for content in ("first", "second", "first"):
        system["content"] = content
        assert _outcome(kept, chat, {}) == _outcome(PromptEncoder(tokenizer, 512), chat, {})
    tools = [dict(LS)]
    for name in ("ls", "cat", "ls"):
        tools[0]["function"] = {**LS["function"], "name": name}
        template = {"tools": tools}
        fresh = _outcome(PromptEncoder(tokenizer, 512), chat, template)
        assert _outcome(kept, chat, template) == fresh


def test_two_encoders_of_two_templates_keep_their_own(tmp_path):
    a = PromptEncoder(load_tokenizer(build_model("llama", tmp_path / "a")), 512)
    other = TEMPLATES["length"]
    b = PromptEncoder(
        load_tokenizer(build_model("llama", tmp_path / "b", chat_template=other)), 512
    )
    for encoder in (a, b, a, b):
        fresh = PromptEncoder(encoder.tokenizer, 512)
        assert _outcome(encoder, CHAT, {}) == _outcome(fresh, CHAT, {})


def test_the_kept_ids_are_not_changed_by_a_request(tmp_path):
    encoder = PromptEncoder(load_tokenizer(build_model("llama", tmp_path / "m")), 512)
    tokens, marks = _outcome(encoder, CHAT, {})
    tokens.append(1)  # the caller's list, not one kept
    kept = [list(ids) for ids in encoder.landmarks._system_renders._kept.values()]
    assert _outcome(encoder, CHAT, {}) == _outcome(PromptEncoder(encoder.tokenizer, 512), CHAT, {})
    assert kept == [list(ids) for ids in encoder.landmarks._system_renders._kept.values()]


# Qwen3.5's and other strict templates: no user message, no render.
NEEDS_USER = (
    "{% set ns = namespace(user=false) %}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{% set ns.user = true %}{% endif %}{% endfor %}"
    "{% if not ns.user %}{{ raise_exception('No user query found in messages.') }}{% endif %}"
    + CHAT_TEMPLATE
)


def test_a_template_that_needs_a_user_message_still_answers_a_chat_with_a_system_prompt(
    tmp_path,
):
    """The landmarks render the system messages alone; a template that refuses a chat with no
    user message refuses that render, not the request (which has one)."""
    path = build_model("llama", tmp_path / "m", chat_template=NEEDS_USER)
    runner = Runner.load(path)
    assert runner.generate(CHAT, max_tokens=2).finish_reason in ("stop", "length")
    # the system turn is measured with a placeholder user message: all of it, and at most
    # the next turn's header besides (none of the user's text)
    encoder = PromptEncoder(load_tokenizer(path), 512)
    tokens = encoder.encode(CHAT)
    marks = encoder.landmarks.find(CHAT, tokens, system_tokens=True)
    kept = encoder.tokenizer.decode(tokens[: marks.system_tokens])
    assert SYSTEM["content"] in kept and "list" not in kept


def test_largest_id_of_a_tokenizer_without_a_vocabulary_keeps_the_check():
    class Bare:
        pass

    class Broken:
        def get_vocab(self):
            return {}

    assert largest_id(Bare()) > 2**40 and largest_id(Broken()) > 2**40


def test_an_embedding_smaller_than_the_tokenizer_still_refuses_ids_past_it(tmp_path):
    tokenizer = load_tokenizer(build_model("llama", tmp_path / "m", added_tokens=["<extra>"]))
    top = max(tokenizer.get_vocab().values())
    encoder = PromptEncoder(tokenizer, top)  # the added token's id has no embedding row
    for prompt in ("a <extra> b", [{"role": "user", "content": "<extra>"}]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            encoder.encode(prompt, parse_control_tokens=True) if not isinstance(
                prompt, str
            ) else encoder.encode(prompt)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        encoder.encode([1, top])
    assert PromptEncoder(tokenizer, top + 1).encode([1, top]) == [1, top]


@pytest.mark.parametrize(
    "ids",
    [[], [0], [2**31 - 1, 2**31, 2**32 - 1], [np.int64(5), np.uint32(7), 9], (1, 2), range(3)],
    ids=["empty", "zero", "high", "numpy-ints", "tuple", "range"],
)
def test_token_array_equals_numpys(ids):
    got, expected = token_array(ids), np.asarray(list(ids), dtype=np.uint32)
    assert got.dtype == np.uint32 and got.tolist() == expected.tolist()


@pytest.mark.parametrize("ids", [[2**32], [-1]])
def test_token_array_refuses_ids_past_uint32(ids):
    with pytest.raises(OverflowError):
        token_array(ids)


def test_follow_up_turns_equal_a_runner_that_renders_the_system_messages_each_time(
    make_runner,
):
    """Two agents' conversations interleaved (two system prompts, tools switched): the
    kept render's Runner reuses what one rendering each time reuses, and answers alike."""
    kept, rendering = make_runner(cache_entries=4), make_runner(cache_entries=4)
    rendering._prompts.landmarks._system_renders = None
    agents = {
        "a": [{"role": "system", "content": "You are agent A. " * 8}],
        "b": [{"role": "system", "content": "You are agent B. " * 8}],
    }
    histories = {
        name: {k: list(v) for k, v in (("kept", c), ("rendering", c))} for name, c in agents.items()
    }
    for turn, name in enumerate("abab" * 2):
        tools = [LS] if turn % 3 else [LS, CAT]
        outcomes = []
        for label, runner in (("kept", kept), ("rendering", rendering)):
            chat = histories[name][label]
            chat.append({"role": "user", "content": f"step {turn}"})
            done = runner.generate(chat, max_tokens=6, tools=tools)
            chat.append({"role": "assistant", "content": done.text})
            outcomes.append((done.text, done.prompt_tokens, done.cached_tokens))
        assert outcomes[0] == outcomes[1], turn
