"""OpenAI's text completions with several prompts (a list of texts or of token id lists, as
lm-evaluation-harness batches them) and `echo`, through the real `openai` client: each
choice is the reply a fresh Runner gives its prompt alone (its choice's seed), by text and
log-probabilities, indexed by prompt then choice; usage counts each prompt once; `echo`
puts the prompt's text before each choice's, plain and streamed, and with `logprobs` the
prompt's own log-probabilities (the model's on the whole prompt, no cache, also where the
cache supplies a prefix), as lm-evaluation-harness reads them; what cannot be answered is a
400 naming the field."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import mlx.core as mx
import numpy as np
import openai
import pytest

from mlxkv import Runner
from mlxkv.runner.results import Completion
from mlxkv.server.reply import turn as turn_module
from mlxkv.server.reply.choices import choice_seed, combined
from tests.server.conftest import SCRIPT, serve
from tests.tolerances import LOGPROB_ABS

PROMPTS = ["Once upon a time there was a cat who", "The recipe for bread begins with"]
SETTINGS = {"max_tokens": 6, "temperature": 1.5, "seed": 5}


def _alone(loaded, prompt, index: int) -> tuple[str, list[float], int]:
    """Text, log-probabilities and prompt tokens of choice `index` of `prompt` on a fresh
    Runner."""
    options = {**SETTINGS, "seed": choice_seed(SETTINGS["seed"], index)}
    chunks = list(Runner(loaded, max_context=512).stream(prompt, logprobs=0, **options))
    completion = chunks[-1].completion
    logprobs = [c.logprob.logprob for c in chunks if c.logprob]
    return completion.text, logprobs, completion.prompt_tokens


def _read(reply, stream: bool):
    """Texts and log-probabilities by index, and the usage, of a reply or its stream."""
    texts, logprobs, usage = defaultdict(str), defaultdict(list), None
    for part in reply if stream else [reply]:
        usage = part.usage or usage
        for choice in part.choices:
            texts[choice.index] += choice.text
            if choice.logprobs:
                logprobs[choice.index] += choice.logprobs.token_logprobs
    return texts, logprobs, usage


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("as_ids", [False, True], ids=["texts", "token-ids"])
def test_each_prompts_choices_are_its_replies_alone(loaded_tiny, stream, as_ids):
    loaded = loaded_tiny("llama")
    tokenizer = loaded.tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS] if as_ids else PROMPTS
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    with serve(runner) as served:
        reply = served.openai(timeout=120).completions.create(
            model="m",
            prompt=prompts,
            n=2,
            logprobs=0,
            stream=stream,
            stream_options={"include_usage": True} if stream else None,
            **SETTINGS,
        )
        texts, logprobs, usage = _read(reply, stream)
    assert sorted(texts) == [0, 1, 2, 3]
    alone = [_alone(loaded, prompt, index) for prompt in prompts for index in range(2)]
    for index, (text, want_logprobs, _) in enumerate(alone):
        assert texts[index] == text, index
        assert logprobs[index] == pytest.approx(want_logprobs, abs=LOGPROB_ABS, rel=1e-4), index
    assert usage.prompt_tokens == alone[0][2] + alone[2][2]
    assert usage.completion_tokens == sum(len(each[1]) for each in alone)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_echo_puts_the_prompt_before_each_choice(loaded_tiny, stream):
    """Texts as sent, token ids decoded; streamed, the prompt comes first, alone."""
    loaded = loaded_tiny("llama")
    ids = loaded.tokenizer.encode(PROMPTS[1])
    with serve(Runner(loaded, max_context=512, max_batch=4)) as served:
        client = served.openai(timeout=120)
        texts, _, _ = _read(
            client.completions.create(
                model="m", prompt=PROMPTS, n=2, echo=True, stream=stream, **SETTINGS
            ),
            stream,
        )
        from_ids = client.completions.create(
            model="m", prompt=ids, echo=True, stream=stream, **SETTINGS
        )
        parts = list(from_ids) if stream else [from_ids]
    for index in range(4):
        prompt = PROMPTS[index // 2]
        assert texts[index] == prompt + _alone(loaded, prompt, index % 2)[0], index
    echoed = loaded.tokenizer.decode(ids)
    assert parts[0].choices[0].text.startswith(echoed)
    assert "".join(p.choices[0].text for p in parts) == echoed + _alone(loaded, ids, 0)[0]
    if stream:
        assert parts[0].choices[0].text == echoed


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": []}, "prompt", "prompt is empty"),
        ({"prompt": ["a story", ""]}, "prompt", "prompt[1] is empty"),
        ({"prompt": "a story", "suffix": "end"}, "suffix", "not supported"),
        ({"prompt": ["a", "b", "c"], "n": 2}, "n", "6 generations (n for each prompt)"),
    ],
    ids=["no-prompt", "an-empty-prompt", "suffix", "over-the-queue"],
)
def test_what_cannot_be_answered_is_a_bad_request(loaded_tiny, body, param, words):
    runner = Runner(loaded_tiny("llama"), max_context=512)
    with serve(runner, max_queue=4) as served, pytest.raises(openai.BadRequestError) as refused:
        served.openai().completions.create(model="m", max_tokens=2, **body)
    error = refused.value.body
    assert error["param"] == param and words in error["message"], error


def _completion(prompt_tokens: int, cached_tokens: int, generated: int) -> Completion:
    return Completion(
        text="", tokens=[], finish_reason="length", prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens, prompt_tps=0.0, generation_tokens=generated,
        generation_tps=0.0, ttft=0.0, peak_memory=0,
    )  # fmt: skip


def test_usage_counts_each_prompt_once_as_its_first_choice_computed_it():
    """Two prompts of two choices: each prompt's tokens once, cached as its choice that
    computed it saw them; a choice that did not end is left out."""
    completions = [
        _completion(10, 0, 3),
        _completion(10, 9, 4),
        None,
        _completion(7, 2, 5),
    ]
    usage = combined(completions, 2)
    assert (usage.prompt_tokens, usage.cached_tokens, usage.generation_tokens) == (17, 2, 12)
    assert combined([None, None], 2) is None


def _model_logprobs(loaded, tokens: list[int]) -> np.ndarray:
    """Log-probabilities (n, vocab) of the model called once on `tokens`, no cache."""
    logits = loaded.model(mx.array([tokens]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(loaded_tiny, stream):
    """lm-evaluation-harness's loglikelihood request (token ids of a context and its
    continuation, `echo`, `logprobs: 1`, `max_tokens: 1`, greedy), after the context alone
    was sent (the cache supplies it): `token_logprobs[ctxlen:-1]` is the continuation's
    log-likelihood, the model's; the first token's entry is null."""
    loaded = loaded_tiny("llama")
    context = loaded.tokenizer.encode(" ".join(PROMPTS * 3))
    continuation = loaded.tokenizer.encode(" and it ran far away")
    tokens = context + continuation
    body = {"model": "m", "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    with serve(Runner(loaded, max_context=512, max_batch=4)) as served:
        client = served.openai(timeout=120)
        client.completions.create(model="m", prompt=[context], max_tokens=1)
        reply = client.completions.create(prompt=[tokens], stream=stream, **body)
        parts = list(reply) if stream else [reply]
        plain = client.completions.create(prompt=[tokens], **body)
    logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for choice in part.choices:
            for field in logprobs:
                logprobs[field] += getattr(choice.logprobs, field) if choice.logprobs else []
    want = _model_logprobs(loaded, tokens)
    assert len(logprobs["token_logprobs"]) == len(tokens) + 1  # and the generated token
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    got = logprobs["token_logprobs"][len(context) : -1]
    expected = [want[i - 1, tokens[i]] for i in range(len(context), len(tokens))]
    np.testing.assert_allclose(got, expected, atol=LOGPROB_ABS, rtol=1e-4)
    for position, top in enumerate(logprobs["top_logprobs"][1:-1]):
        [(text, value)] = top.items()
        assert value == pytest.approx(want[position].max(), abs=LOGPROB_ABS, rel=1e-4)
    assert logprobs["tokens"][1:-1] == [loaded.tokenizer.decode([t]) for t in tokens[1:]]
    assert plain.usage.prompt_tokens_details.cached_tokens >= len(context) - 1
    assert logprobs["text_offset"] == plain.choices[0].logprobs.text_offset  # streamed too
    if stream:
        assert parts[0].choices[0].text == loaded.tokenizer.decode(tokens)  # the echo first


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("echo", [False, True], ids=["generated", "echoed"])
def test_an_eos_that_ends_the_reply_has_its_logprob(scripted_dir, stream, echo):
    """The scripted model writes EOS right after its script's last piece: that token is
    generated (one in the usage) and has its log-probability, last (lm-evaluation-harness
    reads `token_logprobs[ctxlen:-1]`: without it, the continuation's own went, and the
    choice scored 0.0, greedy, over the others)."""
    runner = Runner.load(scripted_dir)
    tokenizer = runner.tokenizer
    prompt = tokenizer.encode("Let") + [tokenizer.convert_tokens_to_ids(SCRIPT[-1])]
    eos = tokenizer.eos_token_ids
    chunks = list(runner.stream(prompt, max_tokens=1, logprobs=1))
    assert chunks[-1].end_token in eos and chunks[-1].completion.generation_tokens == 1
    want = chunks[-1].end_logprob.logprob
    with serve(runner) as served:
        reply = served.openai(timeout=120).completions.create(
            model="m", prompt=[prompt], echo=echo, logprobs=1, max_tokens=1, temperature=0,
            stream=stream, stream_options={"include_usage": True} if stream else None,
        )  # fmt: skip
        parts = list(reply) if stream else [reply]
    logprobs = [
        v for p in parts for c in p.choices if c.logprobs for v in c.logprobs.token_logprobs
    ]
    finishes = [c.finish_reason for p in parts for c in p.choices if c.finish_reason]
    assert finishes == ["stop"] and parts[-1].usage.completion_tokens == 1
    assert len(logprobs) == (len(prompt) if echo else 0) + 1
    assert logprobs[-1] == pytest.approx(want, abs=LOGPROB_ABS) and want > -1.0


def test_the_prompts_logprobs_are_decoded_off_the_event_loop(loaded_tiny, monkeypatch):
    """Each prompt token and its alternatives decoded (0.5 s for 8,000 tokens): on the event
    loop, every other stream and keep-alive waited."""
    loaded = loaded_tiny("llama")
    on_loop: list[bool] = []
    infos = turn_module.Turn._prompt_infos

    def recorded(self, scored):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return infos(self, scored)

    monkeypatch.setattr(turn_module.Turn, "_prompt_infos", recorded)
    with serve(Runner(loaded, max_context=512)) as served:
        served.openai(timeout=120).completions.create(
            model="m", prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=1
        )
    assert on_loop == [False]
