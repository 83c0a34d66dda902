"""Request validation, stop strings, context limit and progress."""

import threading

import pytest

from mlxkv import ModelLoadError, Runner
from mlxkv.decoding.picker import TokenPicker
from mlxkv.decoding.sampling import SamplingParams
from mlxkv.runner.request import Request
from mlxkv.runner.results import CompletionStats
from mlxkv.runner.text.chunks import emit_chunks
from mlxkv.runner.text.stop_strings import StopStrings

BAD_REQUESTS = [
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "empty"),
    ({"prompt": [1, 2, 10**6]}, "outside the vocabulary"),
    ({"prompt": [-1]}, "outside the vocabulary"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": [{"role": "wizard", "content": "hi"}]}, "role 'wizard'"),
    ({"prompt": [{"role": "user"}]}, "content"),
    ({"prompt": "hi", "top_p": 2.0}, "top_p"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_REQUESTS)
def test_bad_input_is_a_clear_value_error_and_leaves_the_cache(make_runner, kwargs, message):
    runner = make_runner("llama")
    runner.generate("The quick brown fox", max_tokens=3)
    before = runner.cache_tokens
    with pytest.raises(ValueError, match=message):
        runner.generate(**kwargs)
    assert runner.cache_tokens == before


def test_missing_model_names_what_was_tried():
    with pytest.raises(ModelLoadError, match="does not exist"):
        Runner.load("/nonexistent/model/dir")


def test_stop_string_cuts_text_and_ends_generation(make_runner):
    runner = make_runner("llama")
    free = runner.generate("The quick brown fox", max_tokens=12)
    assert len(free.text) > 4
    stop = free.text[3:6]
    out = make_runner("llama").generate("The quick brown fox", max_tokens=12, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.find(stop)]


def test_stop_string_in_text_the_detokenizer_held_to_the_end_ends_with_stop(loaded_tiny):
    """Spaces are held back by the streaming detokenizer until the end of generation: a stop
    string made of them is only found then, and still ends the generation as "stop"."""
    tokenizer = loaded_tiny("llama").tokenizer
    (space,) = tokenizer.encode(" ")

    def run(stop):
        request = Request(
            tokens=[1],
            keep=0,
            header_tokens=1,
            params=SamplingParams(max_tokens=12, stop=stop),
            progress=None,
            cancelled=threading.Event(),
        )
        stats = CompletionStats(0.0, prompt_tokens=1, cached=0)
        pick = TokenPicker(lambda x: x, [], [])
        return list(emit_chunks(tokenizer, iter([space] * 12), stats, request, pick))[-1]

    free = run(())
    assert free.completion.text.strip() == "" and len(free.completion.text) > 4
    assert free.finish_reason == "length"
    held = run(("   ",))
    assert (held.completion.text, held.finish_reason, held.completion.stop_string) == (
        "",
        "stop",
        "   ",
    )


def test_stream_text_deltas_join_to_the_completion(make_runner):
    runner = make_runner("llama")
    chunks = list(runner.stream("Paris is the capital of", max_tokens=8))
    assert "".join(c.text for c in chunks) == chunks[-1].completion.text
    assert [c.token for c in chunks[:-1]] == chunks[-1].completion.tokens


def test_progress_reports_every_prefill_chunk(make_runner):
    runner = make_runner("llama", prefill_step_size=4)
    prompt = list(range(3, 13))
    seen = []
    runner.generate(prompt, max_tokens=1, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(4, 10), (8, 10), (9, 10), (10, 10)]


@pytest.mark.parametrize(
    ("segments", "stops", "want"),
    [
        (["Hel", "lo wo", "rld"], ["wor"], ("Hello ", True)),
        (["ab", "c"], ["cd"], ("abc", False)),
        (["a", "b"], ["bc", "x"], ("ab", False)),
    ],
)
def test_stop_strings_hold_back_partial_matches(segments, stops, want):
    matcher = StopStrings(stops)
    text, stopped = "", False
    for segment in segments:
        emitted, stopped = matcher.push(segment)
        text += emitted
        if stopped:
            break
    if not stopped:
        text += matcher.flush()
    assert (text, stopped) == want
