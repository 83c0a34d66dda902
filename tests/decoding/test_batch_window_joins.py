"""Rows joining, leaving and coming back to a decode batch around their sliding windows' wraps
(windows of 8 tokens: gemma3, ministral3, cohere2; ernie4_5 has none), on caches a request
really brings (prefilled in chunks, fed drafts and trimmed back as a speculative pass leaves
them): every step's logits of every row equal one forward pass of that row's whole sequence on
a fresh cache. A sweep under load saw these models' batched requests off; cohere2's was its
reference rendering another reply's ids (`mlxkv.runner.text.replies`), and these pin the batch
itself at each timing a load could bring."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import pytest

from mlxkv.cache.building import make_cache
from mlxkv.decoding.batch import DecodeBatch
from mlxkv.decoding.picker import TokenPicker
from tests.tolerances import assert_logits_close

ARCHS = ["gemma3", "ministral3", "cohere2", "ernie4_5"]


@dataclass(frozen=True)
class Row:
    """A request: `prompt_tokens` prefilled in chunks of `chunk_tokens`, joining before step
    `join_step` to produce `max_tokens`; `drafts` tokens fed after its prompt and trimmed back
    (a rejected draft); leaving the batch before step `detach_step` to decode `alone_steps`
    alone, then joining again."""

    prompt_tokens: int
    join_step: int
    max_tokens: int
    chunk_tokens: int = 64
    drafts: int = 0
    detach_step: int | None = None
    alone_steps: int = 3


SCENARIOS = {
    "join-before-the-wrap": [Row(3, 0, 12), Row(4, 2, 12)],
    "join-as-the-window-wraps": [Row(3, 0, 14), Row(5, 5, 10), Row(2, 6, 9)],
    "short-row-joins-a-wrapped-one": [Row(12, 0, 12), Row(2, 6, 12)],
    "first-row-finishes-first": [Row(9, 0, 3), Row(2, 0, 14), Row(20, 1, 6)],
    "chunked-and-trimmed-caches": [Row(19, 0, 10, chunk_tokens=5, drafts=3), Row(7, 3, 10, 2, 2)],
    "leaves-and-joins-again": [Row(6, 0, 16, detach_step=4), Row(10, 0, 16, detach_step=9)],
}


@dataclass(eq=False)
class _Request:
    spec: Row
    sequence: list[int]  # prompt, then every token picked for it
    cache: object = None
    row: object = None
    left: int = 0
    logits: list[tuple[int, mx.array]] = field(default_factory=list)  # (position, logits)

    def record(self, logits: mx.array) -> None:
        """Logits after feeding the token at the next position; their greedy token follows."""
        position = len(self.sequence) - 1
        self.logits.append((position, logits))
        self.sequence.append(int(mx.argmax(logits).item()))


class _Recorded:
    """The model, handing each batched step's logits to the rows' requests (in row order)."""

    def __init__(self, model, requests_by_row: dict):
        self.model, self.requests_by_row, self.batch = model, requests_by_row, None

    def __call__(self, inputs, cache=None, **kwargs):
        out = self.model(inputs, cache=cache, **kwargs)
        for i, row in enumerate(self.batch._rows):
            self.requests_by_row[id(row)].record(out[i, -1])
        return out


def _greedy() -> TokenPicker:
    return TokenPicker(lambda logits: mx.argmax(logits, axis=-1), [], [], greedy=True)


def _prefilled(model, request: _Request) -> None:
    spec, prompt = request.spec, request.sequence
    request.cache = make_cache(model)
    for start in range(0, len(prompt), spec.chunk_tokens):
        logits = request.cache.forward(model, prompt[start : start + spec.chunk_tokens])
    if spec.drafts:  # a rejected draft: fed after the prompt, trimmed back
        request.cache.forward(model, [7] * spec.drafts)
        assert request.cache.can_trim_to(len(prompt)), "the test's drafts must trim back"
        request.cache.trim_to(len(prompt))
    request.record(logits[0, -1])
    request.left = spec.max_tokens - 1


def _join(batch: DecodeBatch, request: _Request, by_row: dict) -> None:
    last = mx.array([request.sequence[-1]], dtype=mx.uint32)
    request.row = batch.join(request.cache, last, _greedy(), request.left)
    by_row[id(request.row)] = request


def _run(model, rows: list[Row]) -> list[_Request]:
    by_row: dict = {}
    recorded = _Recorded(model, by_row)
    batch = DecodeBatch(recorded, max_rows=len(rows))
    recorded.batch = batch
    requests = [_Request(spec, list(range(20, 20 + spec.prompt_tokens))) for spec in rows]
    for i, request in enumerate(requests):
        request.sequence = [(t * (i + 3)) % 400 + 10 for t in request.sequence]
    for step in range(64):
        for request in requests:
            spec = request.spec
            if step == spec.join_step:
                _prefilled(model, request)
                _join(batch, request, by_row)
            elif step == spec.detach_step and request.row in batch._rows:
                batch.detach(request.row)  # its picked tokens are in `sequence` already
                request.left = request.row.left
                for _ in range(min(spec.alone_steps, request.left)):
                    fed = request.cache.forward(model, [request.sequence[-1]])
                    request.record(fed[0, -1])
                    request.left -= 1
                if request.left > 0:
                    _join(batch, request, by_row)
        if batch.num_rows:
            batch._step()
        elif step > max(spec.join_step for spec in rows):
            break
    assert batch.num_rows == 0, "a row still decoding after the test's steps"
    return requests


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_step_of_every_row_equals_a_fresh_forward_of_its_sequence(
    loaded_tiny, arch, scenario
):
    model = loaded_tiny(arch).model
    for n, request in enumerate(_run(model, SCENARIOS[scenario])):
        assert len(request.sequence) == request.spec.prompt_tokens + request.spec.max_tokens
        fresh = make_cache(model).forward(model, request.sequence[:-1])[0]  # (L, vocab)
        for position, logits in request.logits:
            assert_logits_close(logits, fresh[position], f"row {n} at position {position}")
