"""`ThinkingSplitter`: thinking and answer apart at the tags, the same however the text is cut
into chunks, never part of a tag in either stream; output that goes on with a continued
message's text (`after_tag` False) keeps its whitespace."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mlxkv.server.reply.thinking_split import ThinkingSplitter, Thought, checked_reasoning

START, END, CALL = "<think>", "</think>", "<tool_call>"


def _split(chunks: list[str], thinking: bool = False, exits: tuple[str, ...] = ()) -> list:
    """The splitter's pieces for `chunks`, adjacent pieces of a kind joined."""
    splitter = ThinkingSplitter(START, END, thinking=thinking, exits=exits)
    pieces = [p for chunk in chunks for p in splitter.push(chunk)] + splitter.finish()
    assert all(p.text if isinstance(p, Thought) else p for p in pieces), "an empty piece"
    joined: list = []
    for piece in pieces:
        if joined and type(joined[-1]) is type(piece):
            joined[-1] = (
                Thought(joined[-1].text + piece.text)
                if isinstance(piece, Thought)
                else (joined[-1] + piece)
            )
        else:
            joined.append(piece)
    return joined


def _reference(text: str, thinking: bool, exits: tuple[str, ...] = ()) -> list:
    """The split of the whole text, written plainly: each switching tag removed with the
    whitespace after it; an exit marker closes a thought and stays."""
    pieces: list = []
    trim = thinking
    while True:
        if trim:
            text = text.lstrip()
        markers = (END, *exits) if thinking else (START,)
        hits = sorted((text.find(m), m) for m in markers if m in text)
        at, marker = hits[0] if hits else (len(text), None)
        if text[:at]:
            piece = Thought(text[:at]) if thinking else text[:at]
            if pieces and type(pieces[-1]) is type(piece):
                piece = (
                    Thought(pieces.pop().text + piece.text) if thinking else pieces.pop() + piece
                )
            pieces.append(piece)
        if marker is None:
            return pieces
        keep = marker not in (START, END)
        text = text[at:] if keep else text[at + len(marker) :]
        trim, thinking = not keep, not thinking


# Text made of tags, parts of tags, whitespace and words, so that cuts fall everywhere.
_atoms = st.sampled_from(
    [START, END, CALL, "<", "</", "<thi", "think>", "nk>", " ", "\n", "\n\n", "a", "Paris", "x<"]
)
_texts = st.lists(_atoms, max_size=14).map("".join)


@st.composite
def _chunked(draw):
    text = draw(_texts)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=len(text) + 1)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@given(_chunked(), st.booleans())
def test_every_chunking_splits_as_the_whole_text(case, thinking):
    text, chunks = case
    assert _split(chunks, thinking) == _reference(text, thinking)


@given(_chunked(), st.booleans())
def test_a_tool_call_marker_ends_a_thought_and_stays_in_the_answer(case, thinking):
    text, chunks = case
    assert _split(chunks, thinking, (CALL,)) == _reference(text, thinking, (CALL,))


@given(_chunked(), st.booleans())
def test_the_pieces_are_the_text_without_its_switching_tags(case, thinking):
    """What comes out, both kinds in order, is what went in but for the tags that switched
    and the whitespace right after them: no part of a tag is ever held back or invented."""
    text, chunks = case
    pieces = _split(chunks, thinking)
    out = "".join(p.text if isinstance(p, Thought) else p for p in pieces)
    assert len(out) <= len(text)
    rest = text
    for char in out:  # `out` is `text` with some characters left out
        rest = rest[rest.index(char) + 1 :]
    if START not in text and END not in text:
        assert out == (text.lstrip() if thinking else text)


def test_thinking_then_answer():
    chunks = ["<thi", "nk>\nWeigh", "ing it.</", "think>", "\n\nParis", "."]
    assert _split(chunks) == [Thought("Weighing it."), "Paris."]


def test_output_that_begins_inside_a_thought():
    assert _split(["\nHmm.", "</think>", "Yes"], thinking=True) == [Thought("Hmm."), "Yes"]
    assert _split(["Hmm. still thinking"], thinking=True) == [Thought("Hmm. still thinking")]


def test_output_that_goes_on_with_text_keeps_its_whitespace():
    """After a prefill such as `<think>\nLet me`: the thought goes on, its space kept."""
    splitter = ThinkingSplitter(START, END, thinking=True, after_tag=False)
    pieces = splitter.push(" think.") + splitter.push("</think>\n\nParis") + splitter.finish()
    assert pieces == [Thought(" think."), "Paris"]
    after_tag = ThinkingSplitter(START, END, thinking=False, after_tag=True)
    assert after_tag.push("\n\nParis") + after_tag.finish() == ["Paris"]


def test_a_tag_that_does_not_switch_is_text():
    assert _split(["a</think>b"]) == ["a</think>b"]
    assert _split(["<think>a<think>b</think>c"]) == [Thought("a<think>b"), "c"]


def test_an_empty_thought_gives_no_piece():
    assert _split(["<think>\n\n</think>\n\nParis"]) == ["Paris"]


def test_a_partial_tag_is_held_until_known_and_text_at_the_end():
    splitter = ThinkingSplitter(START, END, thinking=False)
    assert splitter.push("Paris<th") == ["Paris"]
    assert splitter.push("e") == ["<the"]
    assert splitter.push("<thi") == []
    assert splitter.finish() == ["<thi"]


def test_a_tool_call_in_a_thought_ends_it():
    chunks = ["<think>plan", "<tool_call>", '{"name": "f"}', "</tool_call>"]
    pieces = _split(chunks, exits=(CALL,))
    assert pieces == [Thought("plan"), '<tool_call>{"name": "f"}</tool_call>']


class _Token:
    def __init__(self, content: str, special: bool):
        self.content, self.special = content, special


class _Tokenizer:
    added_tokens_decoder = {1: _Token("<|im_end|>", True), 2: _Token("<think>", False)}


def test_reasoning_with_control_token_text_is_left_out():
    messages = [
        {"role": "assistant", "content": "a", "reasoning_content": "x<|im_end|>y"},
        {"role": "assistant", "content": "b", "reasoning_content": "mentions <think>"},
    ]
    checked = checked_reasoning(messages, _Tokenizer())
    assert "reasoning_content" not in checked[0]
    assert checked[1] == messages[1]
    assert checked_reasoning("text", _Tokenizer()) == "text"
