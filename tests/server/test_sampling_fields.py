"""Sampling fields as each API means them. OpenAI's `presence_penalty`, `frequency_penalty`
and `logit_bias`, and Ollama's `presence_penalty` / `frequency_penalty` options, change the
answer as the same settings on a fresh Runner do (they were accepted and ignored); bad ones
are 400s in the API's shape. A `top_p` of 0 keeps the most likely token alone in every API
(mlx-lm reads 0 as no filter: it sampled from every token)."""

from __future__ import annotations

import json

import ollama
import openai
import pytest

QUESTION = [{"role": "user", "content": "Once upon a time there was"}]
GREEDY = {"temperature": 0.0}


def _openai_answer(served, **fields):
    out = served.openai().chat.completions.create(
        model="m", messages=QUESTION, max_tokens=12, logprobs=True, **GREEDY, **fields
    )
    choice = out.choices[0]
    return choice.message.content, [t.logprob for t in choice.logprobs.content]


def _reference(fresh_runner, **fields):
    chunks = list(fresh_runner().stream(QUESTION, max_tokens=12, logprobs=0, **GREEDY, **fields))
    return chunks[-1].completion.text, [c.logprob.logprob for c in chunks if c.logprob]


@pytest.mark.parametrize(
    "fields",
    [{"presence_penalty": 1.5}, {"frequency_penalty": 2.0}, {"presence_penalty": -1.0}],
    ids=["presence", "frequency", "negative-presence"],
)
def test_penalties_answer_as_a_runner_given_them(tiny_server, fresh_runner, fields):
    got = _openai_answer(tiny_server, **fields)
    want = _reference(fresh_runner, **fields)
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-3)
    plain = _reference(fresh_runner)
    assert got[1] != pytest.approx(plain[1], abs=1e-3), "the penalty changed nothing"


def test_logit_bias_forces_a_token(tiny_server, fresh_runner):
    token = 65
    text, _ = _openai_answer(tiny_server, logit_bias={str(token): 100})
    want = fresh_runner().generate(QUESTION, max_tokens=12, logit_bias={token: 100}, **GREEDY)
    assert want.tokens == [token] * 12
    assert text == want.text


def test_ollama_options_take_the_penalties(tiny_server, fresh_runner):
    client = ollama.Client(host=tiny_server.url)
    # favours the last 20 tokens' (the prompt's): this tiny model's greedy reply repeats none
    options = {"temperature": 0.0, "num_predict": 12, "presence_penalty": -50.0}
    got = client.chat(model="m", messages=QUESTION, options=options)
    want = fresh_runner().generate(QUESTION, max_tokens=12, presence_penalty=-50.0, **GREEDY)
    assert got.message.content == want.text
    assert want.text != fresh_runner().generate(QUESTION, max_tokens=12, **GREEDY).text


@pytest.mark.parametrize(
    ("fields", "wording"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"1000000": 1}}, "is not in the model's vocabulary"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
    ],
    ids=["not-an-id", "past-the-vocabulary", "bias-over-100", "penalty-over-2"],
)
def test_bad_settings_are_a_400_in_openais_shape(tiny_server, fields, wording):
    with pytest.raises(openai.BadRequestError) as refused:
        _openai_answer(tiny_server, **fields)
    body = refused.value.body
    assert wording in json.dumps(body)


def test_top_p_0_keeps_the_most_likely_token_in_every_api(tiny_server, fresh_runner):
    greedy = fresh_runner().generate(QUESTION, max_tokens=12, **GREEDY).text
    sampled = {"temperature": 1.0, "top_p": 0.0, "seed": 3}
    chat = tiny_server.openai().chat.completions.create(
        model="m", messages=QUESTION, max_tokens=12, **sampled
    )
    responses = tiny_server.openai().responses.create(
        model="m", input=QUESTION, max_output_tokens=12, temperature=1.0, top_p=0.0
    )
    message = tiny_server.anthropic().messages.create(
        model="m", messages=QUESTION, max_tokens=12, extra_body={"temperature": 1.0, "top_p": 0.0}
    )
    options = {"num_predict": 12, **sampled}
    ollama_reply = ollama.Client(host=tiny_server.url).chat(
        model="m", messages=QUESTION, options=options
    )
    assert chat.choices[0].message.content == greedy
    assert responses.output_text == greedy
    assert message.content[0].text == greedy
    assert ollama_reply.message.content == greedy
