"""Request validation, stop strings, context limit and progress."""

import pytest

from mlxkv import ModelLoadError, Runner
from mlxkv.engine.stop_strings import StopStrings

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


def test_stop_string_in_text_the_detokenizer_held_to_the_end_ends_with_stop(make_runner):
    # The tiny qwen3 answers this prompt with spaces only, which the detokenizer holds back
    # until the end: the stop string is found only then.
    prompt = "one two three four five six seven eight nine ten. " * 6
    free = make_runner("qwen3").generate(prompt, max_tokens=12)
    assert free.text.strip() == "" and len(free.text) > 4
    out = make_runner("qwen3").generate(prompt, max_tokens=12, stop=["   "])
    assert (out.text, out.finish_reason, out.stop_string) == ("", "stop", "   ")


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
