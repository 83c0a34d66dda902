"""What a hostile web page or client tried: DNS rebinding (a Host header naming another
site), forged access-log lines, and framing or third-party content in the chat page."""

from __future__ import annotations

import re
import threading

import anthropic
import openai
import pytest

from mlxkv import Runner
from tests.factories import joined
from tests.server.conftest import serve


@pytest.fixture(scope="module")
def guarded(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=256), allowed_hosts=("my.box",)) as s:
        yield s


@pytest.mark.parametrize(
    "host",
    ["localhost:8080", "127.0.0.1", "[::1]:9", "LOCALHOST", "my.box:8080"],
    ids=["localhost", "ipv4", "ipv6", "upper-case", "allowed"],
)
def test_hosts_that_name_this_server_are_answered(guarded, host):
    status, _ = guarded.request("GET", "/v1/models", headers={"Host": host})
    assert status == 200


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/v1/models", "openai"), ("/v1/messages", "anthropic"), ("/", "openai")],
    ids=["openai", "anthropic", "page"],
)
def test_a_rebinding_host_is_refused_in_the_apis_shape(guarded, path, shape):
    method = "POST" if path == "/v1/messages" else "GET"
    status, body = guarded.request(method, path, b"{}", headers={"Host": "attacker.example"})
    assert status == 403
    error = body["error"]
    assert "attacker.example" in error["message"] and "--allowed-host" in error["message"]
    assert error["type"] == "permission_error"
    if shape == "anthropic":
        assert body["type"] == "error"


def test_a_server_bound_to_every_address_answers_any_name(loaded_tiny):
    with serve(Runner(loaded_tiny("llama")), host="0.0.0.0") as served:
        assert served.request("GET", "/health", headers={"Host": "box.lan:8080"})[0] == 200


def test_a_newline_in_the_path_cannot_forge_a_log_line(guarded, access_log):
    guarded.request("GET", "/v1/models%0a127.0.0.1%20GET%20/admin%20200")
    line = access_log(r"GET /v1/models.*").string
    assert "\n" not in line and line.startswith("GET /v1/models\\n127.0.0.1 GET /admin 200 404")


def test_the_page_forbids_framing_and_other_origins(guarded):
    connection_headers = guarded.response_headers("/")
    policy = connection_headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert connection_headers["x-frame-options"] == "DENY"
    assert connection_headers["x-content-type-options"] == "nosniff"


# A window that a 2 MB message is not far over by its length alone (`tokenizer_facts`): it is
# tokenized, then refused.
WIDE_WINDOW = 2**17


def test_a_long_message_being_tokenized_holds_up_no_other_request(loaded_tiny, monkeypatch):
    """A 16 MB message (under the 32 MiB body limit) held the whole server for 34 s before its
    400: `tokenizers`' `encode` holds the GIL while it runs, so every other request, /health
    too, waited. Tokenized off the event loop by a call that releases the GIL, it holds up
    nobody: /health answers again and again while a 2 MB message is tokenized."""
    with serve(Runner(loaded_tiny("llama"), max_context=WIDE_WINDOW)) as served:
        segments = served.runner._prompts.chat._segments
        encode, tokenizing, tokenized = segments.encode, threading.Event(), threading.Event()

        def watched(text: str) -> list[int]:
            long = len(text) > 1_000_000
            if long:
                tokenizing.set()
            try:
                return encode(text)
            finally:
                if long:
                    tokenized.set()

        monkeypatch.setattr(segments, "encode", watched)
        body = {"max_tokens": 1, "messages": [{"role": "user", "content": "a " * 1_000_000}]}
        answers = []
        sender = threading.Thread(
            target=lambda: answers.append(served.post("/v1/chat/completions", body))
        )
        sender.start()
        assert tokenizing.wait(60)
        answered_meanwhile = 0  # /health answers that came back before the tokenizing ended
        while not tokenized.is_set() and answered_meanwhile < 5:
            assert served.request("GET", "/health")[0] == 200
            answered_meanwhile += not tokenized.is_set()
        joined(sender, timeout_s=120)
    assert answers[0][0] == 400  # over the window, once tokenized
    assert answered_meanwhile == 5  # a stalled server answers once, when the tokenizing ended


FAR_OVER = [{"role": "user", "content": "a " * 200_000}]


def _refusal(guarded, api: str) -> tuple[str, dict]:
    """The message and body of the real client's error for `FAR_OVER`."""
    if api == "openai":
        with pytest.raises(openai.BadRequestError) as refused:
            guarded.openai().chat.completions.create(model="tiny", messages=FAR_OVER, max_tokens=1)
        assert refused.value.code == "context_length_exceeded"
        return refused.value.body["message"], refused.value.body
    with pytest.raises(anthropic.BadRequestError) as refused:
        guarded.anthropic().messages.create(model="tiny", messages=FAR_OVER, max_tokens=1)
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    return refused.value.body["error"]["message"], refused.value.body


@pytest.mark.parametrize(
    ("api", "wording"),
    [
        (
            "openai",
            r"This model's maximum context length is 256 tokens\. However, your "
            r"messages resulted in (\d+) tokens\. Please reduce the length of the messages\.",
        ),
        ("anthropic", r"prompt is too long: (\d+) tokens > 256 maximum"),
    ],
    ids=["openai", "anthropic"],
)
def test_a_message_far_over_the_window_is_refused_before_it_is_tokenized(
    guarded, monkeypatch, api, wording
):
    """A message far over the window was tokenized whole before its 400 (seconds of CPU for
    megabytes). No token stands for more text than the vocabulary's longest, so a text over
    twice the window times that many bytes cannot fit: refused untokenized, in each API's
    wording and shape, counted as the fewest tokens it can take (no more than it takes)."""
    segments = guarded.runner._prompts.chat._segments
    encode, lengths = segments.encode, []

    def recorded(text: str) -> list[int]:
        lengths.append(len(text))
        return encode(text)

    monkeypatch.setattr(segments, "encode", recorded)
    message, _ = _refusal(guarded, api)
    assert lengths == []  # nothing tokenized (256 tokens of any length fit in far less)
    counted = int(re.fullmatch(wording, message).group(1))
    monkeypatch.undo()
    takes = len(guarded.runner.encode(FAR_OVER))
    assert 2 * 256 <= counted <= takes
