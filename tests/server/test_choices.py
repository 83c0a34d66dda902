"""OpenAI's `n`: several choices for one request, chat and text completions, plain and
streamed, through the real `openai` client. Each choice is the reply a fresh Runner gives the
same prompt with its own seed (`choice_seed`), by log-probabilities; the prompt is computed
once (the other choices take it from the cache); usage counts the prompt once and every
choice's tokens; a request's places in the queue are taken at once; the later choices' cache
entries go before other conversations; a client that leaves, or a choice that fails, stops
them all."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import types
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from mlxkv import Runner
from mlxkv.server.reply.choices import choice_seed, start_choices
from mlxkv.server.state import interleaved
from tests.factories import wait_until
from tests.server.conftest import held_until_left, held_worker, serve
from tests.tolerances import LOGPROB_ABS

MESSAGES = [{"role": "user", "content": "Tell me a story about a cat who " + "runs far. " * 8}]
SETTINGS = {"max_tokens": 8, "temperature": 1.5, "seed": 11}


def _alone(loaded, seed: int, prompt=MESSAGES) -> tuple[str, list[float], int]:
    """Text, log-probabilities and prompt tokens of the prompt on a fresh Runner."""
    options = {**SETTINGS, "seed": seed}
    chunks = list(Runner(loaded, max_context=512).stream(prompt, logprobs=0, **options))
    completion = chunks[-1].completion
    return (
        completion.text,
        [c.logprob.logprob for c in chunks if c.logprob],
        completion.prompt_tokens,
    )


@contextlib.contextmanager
def _served(loaded, **options):
    """A server whose Runner records each generation's Completion."""
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    completions = []
    stream = runner.stream

    def recorded(*args, **kwargs):
        for chunk in stream(*args, **kwargs):
            if chunk.completion is not None:
                completions.append(chunk.completion)
            yield chunk

    runner.stream = recorded
    with serve(runner, **options) as served:
        yield served, completions


def _assert_alone(got: list[tuple[str, list[float]]], loaded) -> None:
    for index, (text, logprobs) in enumerate(got):
        want_text, want_logprobs, _ = _alone(loaded, choice_seed(SETTINGS["seed"], index))
        assert text == want_text, index
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ABS, rel=1e-4), index


def test_chat_choices_are_each_the_reply_alone_and_the_prompt_is_computed_once(
    loaded_tiny, access_log
):
    loaded = loaded_tiny("llama")
    with _served(loaded) as (served, completions):
        reply = served.openai(timeout=120).chat.completions.create(
            model="m", messages=MESSAGES, n=3, logprobs=True, **SETTINGS
        )
        wait_until(lambda: len(completions) == 3, what="three generations ended")
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    got = [(c.message.content, [t.logprob for t in c.logprobs.content]) for c in reply.choices]
    _assert_alone(got, loaded)
    assert len({text for text, _ in got}) > 1  # sampled each on its own
    prompt = _alone(loaded, 0)[2]
    computed = sum(c.prompt_tokens - c.cached_tokens for c in completions)
    assert computed <= prompt + 2, [(c.prompt_tokens, c.cached_tokens) for c in completions]
    generated = sum(c.generation_tokens for c in completions)
    assert reply.usage.prompt_tokens == prompt and reply.usage.completion_tokens == generated
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    line = access_log(r"prompt=(\d+) cached=(\d+) generated=(\d+) .*finish=(\S+)")
    assert line.groups() == (str(prompt), "0", str(generated), "length"), line.group(0)


def test_streamed_chat_choices_come_by_index_with_one_usage(loaded_tiny):
    loaded = loaded_tiny("llama")
    with _served(loaded) as (served, _):
        chunks = list(
            served.openai(timeout=120).chat.completions.create(
                model="m",
                messages=MESSAGES,
                n=2,
                logprobs=True,
                stream=True,
                stream_options={"include_usage": True},
                **SETTINGS,
            )
        )
    texts, logprobs, finishes = defaultdict(str), defaultdict(list), {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.logprobs:
            logprobs[choice.index] += [t.logprob for t in choice.logprobs.content]
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    _assert_alone([(texts[i], logprobs[i]) for i in range(2)], loaded)
    assert set(finishes) == {0, 1}
    generated = len(logprobs[0]) + len(logprobs[1])  # one per token (EOS included)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == generated


def test_the_sdk_stream_helper_accumulates_each_choice(scripted_dir):
    """`client.chat.completions.stream` builds each choice from its own chunks (a reply that
    ends by `length` makes the helper raise: the scripted model's ends by itself)."""
    with serve(Runner.load(scripted_dir)) as served:
        client = served.openai(timeout=120)
        arguments = {"model": "m", "messages": MESSAGES, "n": 2, "max_tokens": 200}
        with client.chat.completions.stream(**arguments) as stream:
            final = stream.get_final_completion()
        plain = client.chat.completions.create(**arguments)
    got = [(c.index, c.message.content, c.finish_reason) for c in final.choices]
    assert got == [(c.index, c.message.content, c.finish_reason) for c in plain.choices]
    assert len(got) == 2 and got[0][1] == got[1][1] and got[0][2] == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_text_completion_choices(loaded_tiny, stream):
    loaded = loaded_tiny("llama")
    prompt = "Once upon a time there was a cat who"
    with _served(loaded) as (served, _):
        reply = served.openai(timeout=120).completions.create(
            model="m", prompt=prompt, n=2, stream=stream, **SETTINGS
        )
        texts = defaultdict(str)
        for part in reply if stream else [reply]:
            for choice in part.choices:
                texts[choice.index] += choice.text
    runner_texts = []
    for index in range(2):
        options = {**SETTINGS, "seed": choice_seed(SETTINGS["seed"], index)}
        runner_texts.append(Runner(loaded, max_context=512).generate(prompt, **options).text)
    assert [texts[0], texts[1]] == runner_texts


def test_n_over_the_queue_is_refused_as_a_bad_request(loaded_tiny):
    served_with = _served(loaded_tiny("llama"), max_queue=2)
    with served_with as (served, completions), pytest.raises(openai.BadRequestError) as refused:
        served.openai().chat.completions.create(model="m", messages=MESSAGES, n=3)
    error = refused.value.body
    assert error["param"] == "n" and "--max-queue" in error["message"], error
    assert completions == []


def test_a_client_that_leaves_stops_every_choice(loaded_tiny):
    """The client reads the first chunk of a long streamed reply of three choices, then
    closes: every generation ends (cancelled), none runs on to its max_tokens."""
    with _served(loaded_tiny("llama")) as (served, completions):
        settings = {**SETTINGS, "max_tokens": 400}
        stream = served.openai(timeout=120).chat.completions.create(
            model="m", messages=MESSAGES, n=3, stream=True, **settings
        )
        next(iter(stream))
        stream.close()
        wait_until(lambda: len(completions) == 3, what="the three generations ended")
        worker = served.app.state.mlxkv.worker
        wait_until(lambda: worker._pending == 0, what="the worker let them go")
    assert {c.finish_reason for c in completions} == {"cancelled"}


def test_a_client_that_leaves_before_the_answer_stops_every_choice(loaded_tiny, monkeypatch):
    """Not streamed: each generation is held after its first piece until its cancel is set;
    the client gives up waiting, and all three end."""
    with _served(loaded_tiny("llama")) as (served, completions):
        held_until_left(monkeypatch, served.runner, lambda options: 1)
        client = served.openai(timeout=1.0)
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model="m", messages=MESSAGES, n=3, **SETTINGS)
        wait_until(lambda: len(completions) == 3, what="the three generations ended")
    assert {c.finish_reason for c in completions} == {"cancelled"}


def test_requests_arriving_together_take_their_places_whole(loaded_tiny):
    """Two requests of three choices each, with four places in the queue: one is answered,
    the other refused at once (429, saying what it needs). Started one choice at a time, they
    each took places and both could fail where one fits."""
    with _served(loaded_tiny("llama"), max_queue=4) as (served, completions):
        body = {"model": "m", "messages": MESSAGES, "n": 3, **SETTINGS}
        with held_worker(served) as release, ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(served.post, "/v1/chat/completions", body) for _ in range(2)]
            refused = next(iter(concurrent.futures.as_completed(answers, timeout=60))).result()
            release.set()
            statuses = sorted(answer.result(60)[0] for answer in answers)
    assert refused[0] == 429 and "this request needs 3" in refused[1]["error"]["message"]
    assert statuses == [200, 429] and len(completions) == 3


def test_a_choice_that_fails_to_start_gives_back_every_place(loaded_tiny, monkeypatch):
    """The second choice's start fails (bad input found as it is built): a 400, the first
    choice cancelled, and the queue empty again."""
    with _served(loaded_tiny("llama")) as (served, completions):
        runner, calls = served.runner, itertools.count()
        stream = runner.stream

        def second_fails(*args, **kwargs):
            if next(calls) == 1:
                raise ValueError("this prompt cannot be built")
            return stream(*args, **kwargs)

        monkeypatch.setattr(runner, "stream", second_fails)
        status, body = served.post("/v1/chat/completions", {"messages": MESSAGES, "n": 3})
        worker = served.app.state.mlxkv.worker
        wait_until(lambda: worker._pending == 0, what="every place given back")
    assert status == 400 and "cannot be built" in body["error"]["message"], body
    assert [c.finish_reason for c in completions] in ([], ["cancelled"])


def test_the_other_choices_entries_go_before_other_conversations(loaded_tiny):
    """Two conversations are in the cache, then a request of three choices fills it: the
    next new conversations take the room of the second and third choices' entries, not of
    the two conversations, which are reused when they come back."""
    runner = Runner(loaded_tiny("llama"), max_context=512, cache_entries=5, max_batch=4)
    conversations = [
        [{"role": "user", "content": f"Conversation {i}: " + "tell me more. " * 6}]
        for i in range(4)
    ]
    with serve(runner) as served:
        client = served.openai(timeout=120)

        def ask(messages, n: int = 1):
            return client.chat.completions.create(
                model="m", messages=messages, n=n, max_tokens=4, temperature=1.0
            ).usage

        for messages in conversations[:2]:
            ask(messages)
        ask(MESSAGES, n=3)
        for messages in conversations[2:]:
            ask(messages)
        again = [ask(messages) for messages in conversations[:2]]
    for usage in again:
        assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1, usage


def test_choice_seeds_are_not_another_seeds_choices():
    seeds = {(seed, index): choice_seed(seed, index) for seed in range(20) for index in range(4)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(seeds[seed, 0] == seed for seed in range(20))
    assert all(0 <= value < 2**64 for value in seeds.values())


def test_unseeded_choices_compute_the_prompt_once(loaded_tiny):
    """Without a seed (what clients send), the choices batch: the prompt is still computed
    once, the others wait for it and take it from the cache."""
    loaded = loaded_tiny("llama")
    with _served(loaded) as (served, completions):
        reply = served.openai(timeout=120).chat.completions.create(
            model="m", messages=MESSAGES, n=3, max_tokens=8, temperature=1.0
        )
        wait_until(lambda: len(completions) == 3, what="three generations ended")
    prompt = reply.usage.prompt_tokens
    computed = sum(c.prompt_tokens - c.cached_tokens for c in completions)
    assert computed <= prompt + 2, [(c.prompt_tokens, c.cached_tokens) for c in completions]


def test_a_choice_that_fails_mid_stream_ends_the_stream_with_an_error(loaded_tiny, monkeypatch):
    """The second choice's generation fails after its first chunk: the stream ends with the
    API's error event (the client raises it), and the other choices are cancelled."""
    with _served(loaded_tiny("llama")) as (served, completions):
        runner, calls = served.runner, itertools.count()
        stream = runner.stream

        def second_breaks(*args, **kwargs):
            chunks = stream(*args, **kwargs)
            if next(calls) != 1:
                return chunks

            def broken():
                with contextlib.closing(chunks):
                    yield next(chunks)
                    raise RuntimeError("the engine broke")

            return broken()

        monkeypatch.setattr(runner, "stream", second_breaks)
        client = served.openai(timeout=120)
        with pytest.raises(openai.APIError, match="generation failed"):
            for _ in client.chat.completions.create(
                model="m", messages=MESSAGES, n=3, stream=True, **{**SETTINGS, "max_tokens": 400}
            ):
                pass
        worker = served.app.state.mlxkv.worker
        wait_until(lambda: worker._pending == 0, what="every generation ended")
    assert len(completions) == 2 and {c.finish_reason for c in completions} <= {"cancelled"}


@pytest.mark.parametrize("n", [1, 3], ids=["one", "three"])
def test_choices_one_after_another_leave_the_first_reply_in_the_cache(loaded_tiny, n):
    """With one stream at a time (a large model's `max_batch`), each later choice found the
    first one's entry idle and took it, trimmed to the prompt with its own reply after it, as
    the entry evicted first: the conversation's next turn, with the first reply, missed (4
    tokens cached, not 85). It reuses what one choice leaves: the first reply whole."""
    runner = Runner(loaded_tiny("llama"), max_context=512, cache_entries=3, max_batch=1)
    others = [[{"role": "user", "content": f"Other chat {i}: " + "go on. " * 6}] for i in range(3)]
    with serve(runner) as served:
        client = served.openai(timeout=120)

        def ask(messages, n: int = 1):
            return client.chat.completions.create(
                model="m", messages=messages, n=n, max_tokens=6, temperature=1.0, seed=3
            )

        for messages in others[:2]:
            ask(messages)
        reply = ask(MESSAGES, n=n)
        first = [e.num_tokens for e in runner._pool.entries if e.reply_start > 60]
        ask(others[2])
        turn = [*MESSAGES, {"role": "assistant", "content": reply.choices[0].message.content}]
        usage = ask([*turn, {"role": "user", "content": "And then?"}]).usage
    # the prompt, the first reply but its last token (never fed)
    assert usage.prompt_tokens_details.cached_tokens == first[0], (usage, first)


class _Turn:
    def __init__(self, extra: dict):
        self.extra, self.queued_for_good, self.cancelled = extra, False, False

    def keep_queued(self) -> None:
        self.queued_for_good = True

    def cancel(self) -> None:
        self.cancelled = True


class _Prepared:
    """A PreparedTurn whose starts are recorded; its worker's places always fit."""

    def __init__(self):
        self.sampling = {"temperature": 1.0}
        self.request = types.SimpleNamespace(state=types.SimpleNamespace())
        self.worker = types.SimpleNamespace(hold_places=lambda n: _NoPlaces())

    async def start(self, extra: dict) -> _Turn:
        return _Turn(extra)


class _NoPlaces:
    def release(self) -> None:
        pass


def test_only_the_first_choice_has_a_deadline_for_its_turn():
    """Past `max_batch`, the later choices wait behind the first: each with the queue's
    deadline expired (a 503) while the first ran longer than `queue_timeout_s`. Of several
    prompts (text completions), each prompt's first choice keeps its entry as any request's."""
    choices = asyncio.run(start_choices([_Prepared()], 3))
    assert [turn.queued_for_good for turn in choices.turns] == [False, True, True]
    assert [turn.extra.get("evict_first", False) for turn in choices.turns] == [False, True, True]
    choices = asyncio.run(start_choices([_Prepared(), _Prepared()], 2))
    assert [turn.queued_for_good for turn in choices.turns] == [False, True, True, True]
    evicted_first = [turn.extra.get("evict_first", False) for turn in choices.turns]
    assert evicted_first == [False, True, False, True]


def test_the_interleaved_streams_are_closed_as_the_response_ends():
    """Both choices' streams have an item waiting to be handed over when the response ends:
    each is closed then (its generation cancelled), not left open until collected."""
    closed: list[str] = []

    async def endless(name: str):
        try:
            while True:
                yield name
        finally:
            closed.append(name)

    async def read_one_and_leave() -> list[str]:
        streams = interleaved([endless("a"), endless("b")])
        await anext(streams)
        for _ in range(8):  # the readers run on, up to the hand-over's bound
            await asyncio.sleep(0)
        await streams.aclose()
        return sorted(closed)

    assert asyncio.run(read_one_and_leave()) == ["a", "b"]
