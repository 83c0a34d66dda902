"""Review probe of a vision model's batched decoding through the real server and the real
OpenAI client: concurrent requests (streamed and not, images of different sizes as data URLs,
one text only, one left mid-stream) each answer as a fresh Runner answers it alone, and the
server is consistent after the disconnect (the next request on that conversation, no entry
left in use, an empty batch). Entries are checked after every request by
`tests/invariants.py`."""

from __future__ import annotations

import base64
import io
import threading

import pytest

pytest.importorskip("mlx_vlm")


from mlxkv import Runner  # noqa: E402
from mlxkv.decoding import batch as batch_module  # noqa: E402
from mlxkv.models.loading import load_model  # noqa: E402
from mlxkv.testing.vision_factory import build_vision_model, noise_image  # noqa: E402
from tests.factories import joined, read_in_step, wait_until  # noqa: E402
from tests.server.conftest import held_until_left, serve  # noqa: E402
from tests.tolerances import LOGPROB_ABS  # noqa: E402


def _png(shape, seed) -> bytes:
    out = io.BytesIO()
    noise_image(seed, shape).save(out, format="PNG")
    return out.getvalue()


PNGS = [_png((84, 112, 3), 1), _png((112, 112, 3), 2), _png((56, 112, 3), 3)]


def _openai_messages(png: bytes | None, text: str) -> list[dict]:
    if png is None:
        return [{"role": "user", "content": text}]
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def _runner_messages(png: bytes | None, text: str) -> list[dict]:
    if png is None:
        return [{"role": "user", "content": text}]
    content = [{"type": "image", "image": png}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def _alone(loaded, messages: list[dict], max_tokens: int) -> tuple[str, list[float]]:
    """The text and log-probabilities a fresh Runner gives `messages` alone."""
    fresh = Runner(loaded, max_context=1024, speculative=None)
    chunks = list(fresh.stream(messages, max_tokens=max_tokens, temperature=0.0, logprobs=0))
    return chunks[-1].completion.text, [c.logprob.logprob for c in chunks if c.logprob]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl", "smolvlm"])
def loaded(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("vlm") / request.param
    return load_model(build_vision_model(out, family=request.param))


def test_concurrent_clients_on_a_vision_model_answer_as_alone(loaded, monkeypatch, access_log):
    rows: list[int] = []
    step = batch_module.DecodeBatch._step

    def counting(self):
        rows.append(self.num_rows)
        return step(self)

    asks = [  # (image, question, max_tokens, streamed)
        (PNGS[0], "What is in this picture?", 24, True),
        (PNGS[1], "Describe it.", 20, False),
        (None, "Tell me about caches.", 28, True),
        (PNGS[2], "And this one, at length?", 200, True),  # left mid-stream
    ]
    want = [_alone(loaded, _runner_messages(png, text), n) for png, text, n, _ in asks]
    runner = Runner(loaded, max_context=1024, max_batch=4, speculative=None)
    monkeypatch.setattr(batch_module.DecodeBatch, "_step", counting)
    got: list = [None] * len(asks)
    left_after = 4
    # the server's worker reads each stream: all four decode in one step before any third
    # chunk, and the one left waits for its client to leave
    read_in_step(monkeypatch, runner, len(asks))
    held_until_left(
        monkeypatch, runner, lambda options: {200: left_after}.get(options["max_tokens"])
    )
    with serve(runner, model_name="tiny-vl") as served:
        client = served.openai()

        def ask(i):
            png, text, n, streamed = asks[i]
            options = {"model": "tiny-vl", "max_tokens": n, "temperature": 0.0, "logprobs": True}
            messages = _openai_messages(png, text)
            if not streamed:
                choice = client.chat.completions.create(messages=messages, **options).choices[0]
                got[i] = choice.message.content, [t.logprob for t in choice.logprobs.content]
                return
            stream = client.chat.completions.create(messages=messages, stream=True, **options)
            pieces, logprobs = [], []
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                if chunk.choices and chunk.choices[0].logprobs:
                    logprobs += [t.logprob for t in chunk.choices[0].logprobs.content]
                if i == 3 and len(pieces) == left_after:
                    stream.close()  # the client leaves mid-reply
                    break
            got[i] = "".join(pieces), logprobs

        threads = [threading.Thread(target=lambda i=i: ask(i)) for i in range(len(asks))]
        for thread in threads:
            thread.start()
        joined(*threads, timeout_s=120)
        for i, ((text, logprobs), (want_text, want_logprobs)) in enumerate(
            zip(got, want, strict=True)
        ):
            assert text == want_text if i < 3 else want_text.startswith(text), i
            assert 0 < len(logprobs) <= len(want_logprobs) and (
                i == 3 or len(logprobs) == len(want_logprobs)
            ), i
            assert logprobs == pytest.approx(want_logprobs[: len(logprobs)], abs=LOGPROB_ABS), i
        access_log(r"POST /v1/chat/completions 200 .*finish=cancelled")
        wait_until(lambda: not runner._pool._in_use, what="every entry released")
        assert runner._dispatch._batching.batch.num_rows == 0
        assert runner._dispatch._batching.streams == 0
        # the left conversation again, and the others' next turn, as a fresh Runner's
        again = client.chat.completions.create(
            model="tiny-vl",
            messages=_openai_messages(PNGS[2], "And this one, at length?"),
            max_tokens=24,
            temperature=0.0,
        )
        fresh = _alone(loaded, _runner_messages(PNGS[2], "And this one, at length?"), 24)
        assert again.choices[0].message.content == fresh[0]
    assert min(len(logprobs) for _, logprobs in want) >= 2  # each decodes past its first
    assert max(rows) == len(asks), rows
