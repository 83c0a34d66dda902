"""Edges of a tool-call reply sent back as its generated ids (`text.replies.call_reply_key`):
the prompt takes those ids only where they are the reply the client sent back, whole, and
renders the other messages as the chat template does; every API that sends calls back
(Responses' function_call items, Ollama's arguments as objects) reuses the whole reply; a
reply cut by max_tokens, another domain's reply, and a template that refuses a call reply
without its calls render from the template (text replies there still as their ids)."""

from __future__ import annotations

import functools
import json

import ollama
import pytest
from mlx_lm.tool_parsers import json_tools, mistral

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.runner.results import Completion
from mlxkv.runner.text.replies import known_reply, remember_reply, replies_for
from mlxkv.server.reply.tool_calls import ToolCall, ToolCallSplitter
from mlxkv.server.reply.turn import reply_keyer
from mlxkv.testing.factory import TOOLS_CHAT_TEMPLATE, build_scripted_model
from tests.server.conftest import SCRIPT, WEATHER, build_template_model, serve

ASK = [{"role": "user", "content": "Weather in Paris?"}]
RESPONSES_TOOLS = [{"type": "function", **WEATHER["function"]}]
# A tool result the template writes with the name of the call it answers (found in the
# message before it, as gpt-oss's template does with its `last_tool_call`).
NAMED_RESULTS = TOOLS_CHAT_TEMPLATE.replace(
    "<|im_start|>user\n<tool_response>",
    "{% set calls = messages[loop.index0 - 1].tool_calls %}"
    '<|im_start|>user\n<tool_response{% if calls %} name="{{ calls[0].function.name }}"'
    "{% endif %}>",
)
# Opens each round of tool results with a marker that a message with calls arms (as
# DeepSeek-V3's template does with `ns.is_output_first`).
RESULT_ROUNDS = (
    TOOLS_CHAT_TEMPLATE.replace(
        "{% for message in messages %}",
        "{% set ns = namespace(first=true) %}{% for message in messages %}",
        1,
    )
    .replace(
        "<|im_start|>assistant\n{{ message['content'] }}",
        "{% set ns.first = true %}<|im_start|>assistant\n{{ message['content'] }}",
        1,
    )
    .replace(
        "<|im_start|>user\n<tool_response>",
        "<|im_start|>user\n{% if ns.first %}<results>{% set ns.first = false %}{% endif %}"
        "<tool_response>",
    )
)
# Refuses a tool result after a message without calls, as Mistral's templates do.
STRICT = TOOLS_CHAT_TEMPLATE.replace(
    "{% elif message['role'] == 'tool' %}",
    "{% elif message['role'] == 'tool' %}"
    "{% if not messages[loop.index0 - 1].tool_calls %}"
    "{{ raise_exception('tool results must follow tool calls') }}{% endif %}",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = build_scripted_model(tmp_path_factory.mktemp("tools") / "model", SCRIPT)
    with serve(Runner(load_model(path), max_context=512), model_name="m") as s:
        yield s


def _sent_back(message, result: str = "Sunny") -> list[dict]:
    """The second turn as the server hands it to the template: the OpenAI reply with its
    calls (arguments as objects), then the tool's result."""
    calls = [
        {
            "id": call.id,
            "type": "function",
            "function": {
                "name": call.function.name,
                "arguments": json.loads(call.function.arguments),
            },
        }
        for call in message.tool_calls
    ]
    reply = {"role": "assistant", "content": message.content or "", "tool_calls": calls}
    return [*ASK, reply, {"role": "tool", "tool_call_id": calls[0]["id"], "content": result}]


def _template_text(runner: Runner, messages: list[dict]) -> str:
    return runner.tokenizer.apply_chat_template(
        messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )


def test_responses_function_call_items_sent_back_reuse_the_whole_reply(served):
    client = served.openai()
    first = client.responses.create(
        model="m", input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=40
    )
    held = len(served.runner.cache_tokens)
    call = next(item for item in first.output if item.type == "function_call")
    items = [*ASK, *[item.model_dump(exclude_none=True) for item in first.output]]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"})
    second = client.responses.create(
        model="m", input=items, tools=RESPONSES_TOOLS, max_output_tokens=1
    )
    assert second.usage.input_tokens_details.cached_tokens == held


def test_ollama_calls_sent_back_with_object_arguments_reuse_the_whole_reply(served):
    client = ollama.Client(host=served.url)
    first = client.chat(model="m", messages=ASK, tools=[WEATHER], options={"num_predict": 40})
    assert first.message.tool_calls
    held = list(served.runner.cache_tokens)
    reply = first.message.model_dump(exclude_none=True)
    messages = [*ASK, reply, {"role": "tool", "content": "Sunny", "tool_name": "get_weather"}]
    client.chat(model="m", messages=messages, tools=[WEATHER], options={"num_predict": 1})
    # Ollama reports no cached count: the second prompt starts with all the first turn held
    assert served.runner.cache_tokens[: len(held)] == held


def test_a_reply_of_another_domain_renders_from_the_template(served):
    client = served.openai()
    first = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=40)
    messages = _sent_back(first.choices[0].message)
    text = _template_text(served.runner, messages)
    other = served.runner.encode(messages, tools=[WEATHER], cache_salt="tenant-b")
    assert served.runner.tokenizer.decode(other) == text
    assert served.runner.encode(messages, tools=[WEATHER]) != other  # its own domain: its ids


def test_a_call_reply_cut_by_max_tokens_renders_its_calls_from_the_template(served):
    """Cut before its end marker, the call still parses (and is sent as a whole call): the
    prompt writes it whole, as the template does, not as the cut the model wrote. (A domain of
    its own: the same text and call generated whole by another test is another reply.)"""
    client, salt = served.openai(), "cut"
    first = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], max_tokens=3, extra_body={"cache_salt": salt}
    )
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].message.tool_calls, "the unterminated call parses"
    messages = _sent_back(first.choices[0].message)
    ids = served.runner.encode(messages, tools=[WEATHER], cache_salt=salt)
    assert served.runner.tokenizer.decode(ids) == _template_text(served.runner, messages)


# Two calls, text before, between and after them (each piece one token, none repeated).
PARALLEL = (
    "Let",
    "<tool_call>",
    '{"name":"get_weather","arguments":{"city":"Paris"}}',
    "</tool_call>",
    "x<tool_call>",
    '{"name":"get_weather","arguments":{"city":"Rome"}}',
    "</tool_call>y",
)


@pytest.mark.parametrize(
    ("calls", "trim", "as_generated"),
    [([0, 1], "", True), ([1, 0], "", False), ([0], "", False), ([0, 1], "y", False)],
    ids=["as-sent", "calls-swapped", "one-call-left-out", "text-trimmed"],
)
def test_parallel_calls_take_their_ids_only_as_the_reply_sent_them(
    tmp_path, calls, trim, as_generated
):
    """The reply's text ("Letxy": its pieces around the calls, joined) and both calls, in
    order: the ids; calls in another order, fewer calls or other text: the template's form."""
    path = build_scripted_model(tmp_path / "parallel", PARALLEL)
    with serve(Runner(load_model(path), max_context=512), model_name="m") as served:
        client = served.openai()
        first = client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], max_tokens=40
        )
        message = first.choices[0].message
        assert message.content == "Letxy" and len(message.tool_calls) == 2
        messages = _sent_back(message)
        reply = messages[1]
        reply["content"] = reply["content"].rstrip(trim)
        reply["tool_calls"] = [reply["tool_calls"][i] for i in calls]
        ids = served.runner.encode(messages, tools=[WEATHER])
        text = _template_text(served.runner, messages)
        rendered = served.runner.tokenizer.decode(ids)
    assert (rendered != text) == as_generated
    assert ("</tool_call>x<tool_call>" in rendered) == as_generated  # as the model wrote it


def test_count_tokens_agrees_with_the_generations_prompt_on_a_call_reply_sent_back(served):
    client = served.anthropic()
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    first = client.messages.create(model="m", messages=ASK, tools=tools, max_tokens=40)
    call = next(block for block in first.content if block.type == "tool_use")
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}
    messages = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [result]},
    ]
    counted = client.messages.count_tokens(model="m", messages=messages, tools=tools)
    second = client.messages.create(model="m", messages=messages, tools=tools, max_tokens=1)
    usage = second.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    assert usage.cache_read_input_tokens > 0


def test_a_known_call_reply_leaves_the_tool_result_as_the_template_writes_it(tmp_path):
    """A template that names a tool result after its call (gpt-oss's) writes that result from
    the calls: the reply renders from the template (`replies.check_calls_apart`), and the
    result stays as the template writes it."""
    path = build_template_model(tmp_path / "named", SCRIPT, NAMED_RESULTS)
    with serve(Runner(load_model(path), max_context=512), model_name="m") as served:
        client = served.openai()
        first = client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], max_tokens=40
        )
        messages = _sent_back(first.choices[0].message)
        text = _template_text(served.runner, messages)
        assert '<tool_response name="get_weather">' in text
        ids = served.runner.encode(messages, tools=[WEATHER])
    tail = text[text.index("<|im_end|>\n<|im_start|>user\n<tool_response") :]
    assert served.runner.tokenizer.decode(ids).endswith(tail)


def test_known_call_replies_leave_each_round_of_tool_results_as_the_template_opens_it(
    tmp_path,
):
    """A template whose message with calls arms the opening of the next round of tool results
    (DeepSeek-V3's `ns.is_output_first`): the replies render from the template, each round
    opened (`replies.check_calls_apart`)."""
    path = build_template_model(tmp_path / "rounds", SCRIPT, RESULT_ROUNDS)
    with serve(Runner(load_model(path), max_context=512), model_name="m") as served:
        client = served.openai()
        messages = list(ASK)
        for _ in range(2):  # the scripted model calls again: two replies, both known
            reply = client.chat.completions.create(
                model="m", messages=messages, tools=[WEATHER], max_tokens=40
            )
            messages = [*messages, *_sent_back(reply.choices[0].message)[len(ASK) :]]
        assert _template_text(served.runner, messages).count("<results>") == 2
        ids = served.runner.encode(messages, tools=[WEATHER])
    assert served.runner.tokenizer.decode(ids).count("<results>") == 2


def test_text_replies_keep_their_ids_where_the_template_refuses_a_call_reply_without_calls(
    tmp_path,
):
    """A strict template refuses the known call reply rendered without its calls: that reply
    renders from the template, and a text reply earlier in the conversation still as the ids
    the model generated (here one id a character, which its text does not encode to)."""
    path = build_template_model(tmp_path / "strict", SCRIPT, STRICT)
    with serve(Runner(load_model(path), max_context=512), model_name="m") as served:
        tokenizer = served.runner.tokenizer
        said = "Hello there"
        said_ids = [tokenizer.encode(c, add_special_tokens=False)[0] for c in said]
        assert tokenizer.decode(said_ids) == said
        assert tokenizer.encode(said, add_special_tokens=False) != said_ids
        replies_for(tokenizer).remember(_completion(said, said_ids), None)
        first = served.openai().chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], max_tokens=40
        )
        greeting = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": said}]
        messages = [*greeting, *_sent_back(first.choices[0].message)]
        ids = served.runner.encode(messages, tools=[WEATHER])
    assert tokenizer.decode(ids) == _template_text(served.runner, messages)
    assert any(ids[i : i + len(said_ids)] == said_ids for i in range(len(ids)))


def _completion(text: str, tokens: list[int]) -> Completion:
    return Completion(
        text=text,
        tokens=tokens,
        finish_reason="stop",
        prompt_tokens=1,
        cached_tokens=0,
        prompt_tps=0.0,
        generation_tokens=len(tokens) + 1,
        generation_tps=0.0,
        ttft=0.0,
        peak_memory=0,
    )


class _Tokenizer:
    """Stands for a model's tokenizer: what the reply memory is kept by."""


def _generated_call(tokenizer, splitter: ToolCallSplitter, pieces: list[tuple[str, int]]):
    """The one call of a reply of `pieces` (text, token), remembered by its key as the Runner
    remembers a server turn's reply (`turn.reply_keyer`)."""
    completion = _completion("".join(p for p, _ in pieces), [t for _, t in pieces])
    key = reply_keyer(splitter, None, tokenizer)(completion)
    remember_reply(tokenizer, completion, None, key)
    (call,) = [
        p for p in splitter.push(completion.text) + splitter.finish() if isinstance(p, ToolCall)
    ]
    return call


def _sent_call(call: ToolCall, **call_id) -> dict:
    """The reply of `call` alone as a client sends it back, with the id given (or none)."""
    function = {"name": call.name, "arguments": call.arguments}
    return {"role": "assistant", "content": "", "tool_calls": [{**call_id, "function": function}]}


def _known(tokenizer, message: dict) -> list[int] | None:
    return known_reply(message, replies_for(tokenizer).known_in([message], None).get)


def test_replies_that_differ_only_in_the_call_ids_the_model_wrote_are_known_apart():
    """Mistral's 9-character ids are the model's: each reply is known with its own (the
    newest's ids no longer stand for both, which showed a call id no tool result answered),
    and an id the model did not write is no reply's. Seen failing with the ids left out of
    the key (the second reply's ids taken for the first)."""
    tokenizer = _Tokenizer()
    splitter = functools.partial(ToolCallSplitter, "[TOOL_CALLS]", "", mistral.parse_tool_call)
    for call_id, token in (("abcdefghi", 7), ("zyxwvutsr", 8)):
        body = f'[{{"name":"get_weather","arguments":{{"city":"Paris"}},"id":"{call_id}"}}]'
        call = _generated_call(tokenizer, splitter([WEATHER]), [("[TOOL_CALLS]", 5), (body, token)])
        assert call.id == call.written_id == call_id
    assert _known(tokenizer, _sent_call(call, id="abcdefghi")) == [5, 7]
    assert _known(tokenizer, _sent_call(call, id="zyxwvutsr")) == [5, 8]
    assert _known(tokenizer, _sent_call(call, id="otherid12")) is None
    assert _known(tokenizer, _sent_call(call)) is None


def test_a_reply_whose_call_ids_were_made_here_is_known_with_or_without_them():
    """Ids made here (`call_...`) are in no reply's token ids: the client's ids, or none (as
    Ollama's client sends), find the reply."""
    tokenizer = _Tokenizer()
    splitter = ToolCallSplitter("<tool_call>", "", json_tools.parse_tool_call, [WEATHER])
    body = '{"name":"get_weather","arguments":{"city":"Paris"}}'
    call = _generated_call(tokenizer, splitter, [("<tool_call>", 5), (body, 6)])
    assert call.id.startswith("call_") and call.written_id is None
    assert _known(tokenizer, _sent_call(call, id=call.id)) == [5, 6]
    assert _known(tokenizer, _sent_call(call)) == [5, 6]


def test_a_reply_with_a_call_id_replaced_here_is_not_known_by_its_calls():
    """An id the model wrote in a shape its template refuses (Mistral's: 9 letters and
    digits) goes out replaced: the reply's ids would show the model's id, which no tool
    result answers, so the reply renders from the template."""
    tokenizer = _Tokenizer()
    splitter = ToolCallSplitter("[TOOL_CALLS]", "", mistral.parse_tool_call, [WEATHER])
    body = '[{"name":"get_weather","arguments":{"city":"Paris"},"id":"short"}]'
    call = _generated_call(tokenizer, splitter, [("[TOOL_CALLS]", 5), (body, 9)])
    assert call.written_id == "short" != call.id
    assert _known(tokenizer, _sent_call(call, id=call.id)) is None


def _call_rounds(served, messages: list[dict], salt: str, rounds: int) -> list[dict]:
    """`messages` and `rounds` call replies of the scripted model, each sent back with its
    tool result, in `salt`'s domain."""
    client = served.openai()
    for _ in range(rounds):
        reply = client.chat.completions.create(
            model="m",
            messages=messages,
            tools=[WEATHER],
            max_tokens=6,
            extra_body={"cache_salt": salt},
        )
        messages = [*messages, *_sent_back(reply.choices[0].message)[len(ASK) :]]
    return messages


def test_six_rounds_of_known_call_replies_all_take_their_ids(served):
    """Replies at messages 1, 3, ... 11: the slot of reply 1 is not read inside reply 11's
    (`replies.slot_text`), so all six take the ids the model wrote (its call without the
    template's spaces); seen failing (none did) with slots that end at their index."""
    salt = "six-rounds"
    messages = _call_rounds(served, list(ASK), salt, 6)
    ids = served.runner.encode(messages, tools=[WEATHER], cache_salt=salt)
    assert served.runner.tokenizer.decode(ids).count(SCRIPT[2]) == 6


# Writes a reply with calls as its calls alone, its content left out (Llama 3.1's, Mistral's
# and Hermes 2 Pro's templates).
CALLS_ONLY = TOOLS_CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{{ message['content'] }}{% for tool_call",
    "<|im_start|>assistant\n{% for tool_call",
    1,
)


def test_a_reply_of_calls_alone_takes_its_ids_where_the_template_leaves_out_content(tmp_path):
    """Llama 3.1, Mistral and Hermes write a call reply's calls and leave its content out:
    the template writes nothing else from them, so the reply takes its ids
    (`replies.check_calls_apart` matches the text around the masked reply)."""
    path = build_template_model(tmp_path / "calls-only", SCRIPT[1:], CALLS_ONLY)
    with serve(Runner(load_model(path), max_context=512), model_name="m") as served:
        client = served.openai()
        first = client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], max_tokens=40
        )
        assert not first.choices[0].message.content and first.choices[0].message.tool_calls
        held = len(served.runner.cache_tokens)
        second = client.chat.completions.create(
            model="m", messages=_sent_back(first.choices[0].message), tools=[WEATHER], max_tokens=1
        )
    assert second.usage.prompt_tokens_details.cached_tokens == held


def test_known_call_replies_beside_control_token_text_take_their_ids(served):
    """Two known call replies and a user message quoting a control token: the replies take
    their ids (the model's call, without the template's spaces), the quote stays text."""
    salt = "beside-tainted"
    quoted = [{"role": "user", "content": "Weather in Paris? <|im_end|> quoted"}]
    messages = _call_rounds(served, quoted, salt, 2)
    ids = served.runner.encode(messages, tools=[WEATHER], cache_salt=salt)
    tokenizer = served.runner.tokenizer
    assert tokenizer.decode(ids).count(SCRIPT[2]) == 2
    text = _template_text(served.runner, messages)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == text.count("<|im_end|>") - 1


def test_a_call_that_does_not_parse_is_logged_once(caplog):
    """The turn's reading of the reply logs it; the key's second reading does not."""
    splitter = ToolCallSplitter("<tool_call>", "</tool_call>", json_tools.parse_tool_call, None)
    key = reply_keyer(splitter, None, _Tokenizer())
    text = 'Let<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    text += "<tool_call>not json</tool_call>"
    with caplog.at_level("WARNING", logger="mlxkv.server.reply.tool_calls"):
        pieces = splitter.push(text) + splitter.finish()
        assert key(_completion(text, [5, 6])) is not None
    assert sum(isinstance(p, ToolCall) for p in pieces) == 1
    assert [r.getMessage()[:25] for r in caplog.records] == ["tool call not parsed, ret"]
