"""Stop strings on streamed text, against a plain reference: however the text is split into
segments, the emitted text is the text before the first stop string to end (the longest one
ending there), and nothing emitted is ever taken back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mlxkv.runner.text.stop_strings import StopStrings

_TEXT = st.text(alphabet="abc", max_size=40)
_STOPS = st.lists(st.text(alphabet="abc", min_size=1, max_size=5), max_size=5)


def _reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


@given(_TEXT, _STOPS, st.lists(st.integers(min_value=0, max_value=40), max_size=8))
def test_streamed_matching_equals_the_reference(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    segments = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    matcher = StopStrings(stops)
    emitted = ""
    for segment in segments:
        safe, stopped = matcher.push(segment)
        emitted += safe
        if stopped:
            break
    else:
        emitted += matcher.flush()
    assert (emitted, matcher.matched) == _reference(text, stops)


def test_held_text_is_bounded_by_the_longest_stop():
    """Many long stop strings sharing a prefix the text keeps repeating: what is held back
    never grows past the longest partial match."""
    stops = ["x" * 900 + str(i) for i in range(64)]
    matcher = StopStrings(stops)
    for _ in range(5000):
        safe, stopped = matcher.push("x")
        assert not stopped
    assert len(matcher.flush()) == 900
