"""What a Responses object repeats of its request, and the log-probabilities `include` asks
for, through the real `openai` client. Before, the object lacked fields OpenAI's has (and the
Open Responses schema requires: `completed_at`, `text`, `reasoning`, `truncation`, ...),
said `temperature: null`, and `include: ["message.output_text.logprobs"]` gave empty lists.
Log-probabilities are checked against a fresh Runner's."""

from __future__ import annotations

import pytest

MAX_TOKENS = 6
QUESTION = "Once upon a time there was"
TOOL = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {}}}
SETTINGS = {
    "completed_at": (int, type(None)), "truncation": str, "text": dict, "presence_penalty": float,
    "frequency_penalty": float, "top_logprobs": int, "reasoning": dict, "background": bool,
    "service_tier": str, "metadata": dict, "temperature": float, "top_p": float,
}  # fmt: skip


@pytest.fixture(scope="module")
def served(module_server):
    return module_server


def test_a_response_repeats_every_setting(served):
    ask = {"model": "m", "input": QUESTION, "max_output_tokens": 16, "tools": [TOOL]}
    raw = served.openai().responses.with_raw_response.create(**ask, metadata={"k": "v"})
    body = raw.http_response.json()
    missing = {key for key, kind in SETTINGS.items() if not isinstance(body.get(key), kind)}
    assert not missing, {key: body.get(key) for key in missing}
    assert (body["completed_at"] is None) == (body["status"] != "completed")  # as OpenAI's
    assert body["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
    assert body["metadata"] == {"k": "v"}
    assert body["tools"][0]["strict"] is False  # its arguments are not held to its schema
    assert body["usage"]["input_tokens_details"]["cache_write_tokens"] == 0
    strict = served.openai().responses.create(**{**ask, "tools": [{**TOOL, "strict": True}]})
    assert strict.tools[0].strict is True  # as asked
    for key in ("max_tool_calls", "safety_identifier", "prompt_cache_key", "user"):
        assert key in body and body[key] is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_asked_with_include_are_a_fresh_runners(served, fresh_runner, stream):
    client = served.openai()
    ask = {"model": "m", "input": QUESTION, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    ask |= {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    if stream:
        events = list(client.responses.create(**ask, stream=True))
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        streamed = [token.logprob for delta in deltas for token in delta.logprobs]
        response = events[-1].response
    else:
        response = client.responses.create(**ask)
    (part,) = response.output[0].content
    messages = [{"role": "user", "content": QUESTION}]
    chunks = fresh_runner().stream(messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    want = [chunk.logprob.logprob for chunk in chunks if chunk.logprob is not None]
    assert [token.logprob for token in part.logprobs] == pytest.approx(want, abs=1e-4)
    assert all(len(token.top_logprobs) == 2 for token in part.logprobs)
    if stream:  # the deltas carry their own tokens' (the last, textless, only in the part)
        assert streamed == [token.logprob for token in part.logprobs][: len(streamed)]
        (done,) = [e for e in events if e.type == "response.content_part.done"]
        assert done.part.logprobs == part.logprobs
    plain = client.responses.create(**{**ask, "include": None})
    assert plain.output[0].content[0].logprobs == []  # none unless `include` asks
