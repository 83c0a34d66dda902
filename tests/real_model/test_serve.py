"""`mlxkv serve` as a user starts it (a subprocess, the default model, port 0), asked through the
real OpenAI and Anthropic clients."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.processes import ready_url

ROOT = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
_READY_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def server_url(converted_cache):
    """The server on its defaults; $MLXKV_CACHE_DIR (`converted_cache`) holds the conversion
    and the default disk tier (kv/)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxkv.cli", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, MLXKV_CACHE_DIR=str(converted_cache)),
    )
    try:
        yield ready_url(process, _READY_TIMEOUT_S)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        assert process.returncode == 130, stderr  # the shell's code for Ctrl-C
        assert "Traceback" not in stderr
        assert re.search(r"POST /v1/messages 200 .* cached=\d+ .*kv cache:", stderr), stderr
        # on the way out the server wrote its entries to the default disk tier
        assert list((converted_cache / "kv").glob("*/*.safetensors")), stderr


def test_openai_client_gets_paris(server_url):
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model="gpt-4o-mini", messages=QUESTION, max_tokens=24)
    assert "Paris" in out.choices[0].message.content


def test_anthropic_client_gets_paris_and_a_cache_read(server_url):
    client = anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0)
    for _ in range(2):  # the second time the question's tokens are cached
        with client.messages.stream(
            model="claude-local", messages=QUESTION, max_tokens=24
        ) as stream:
            text = "".join(stream.text_stream)
            usage = stream.get_final_message().usage
        assert "Paris" in text
    assert usage.cache_read_input_tokens > 0


class CityInfo(BaseModel):
    city: str
    country: str


def test_ollama_chat_without_content_type_and_capabilities(server_url):
    """LiteLLM's `ollama_chat/` provider sends its JSON with no Content-Type; SmolLM2's
    template drops tools, so /api/show lists none."""
    body = {"model": "smollm2", "messages": QUESTION, "stream": False}
    with httpx.Client(timeout=120) as client:
        # raw content: httpx sends no Content-Type, as LiteLLM's `data=` call
        reply = client.post(f"{server_url}/api/chat", content=json.dumps(body))
        assert reply.status_code == 200, reply.text
        assert "Paris" in reply.json()["message"]["content"]
        show = client.post(f"{server_url}/api/show", json={"model": "SmolLM2-135M-Instruct"})
    assert show.json()["capabilities"] == ["completion"]


def test_pydantic_ai_typed_output(server_url):
    """pydantic-ai's default typed output: a required `final_result` call, strict schema."""
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
    parameters = {**CityInfo.model_json_schema(), "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "final_result", "parameters": parameters}}
    out = client.chat.completions.create(
        model="gpt-4o-mini", messages=QUESTION, tools=[tool], tool_choice="required",
        max_tokens=80,
    )  # fmt: skip
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "final_result"
    CityInfo.model_validate_json(call.function.arguments)


def test_langchain_chat_anthropic_structured_output(server_url):
    client = anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0)
    tool = {
        "name": "CityInfo",
        "description": "A city.",
        "input_schema": CityInfo.model_json_schema(),
    }
    out = client.messages.create(
        model="claude-local", messages=QUESTION, tools=[tool], max_tokens=80,
        tool_choice={"type": "tool", "name": "CityInfo"},
    )  # fmt: skip
    (block,) = out.content
    assert block.type == "tool_use" and out.stop_reason == "tool_use"
    CityInfo.model_validate(block.input)


# A tool without parameters, and one whose keys come from `properties` and an `anyOf` beside
# it, each with the arguments SmolLM2 may write: only the listed keys, and the call ends.
_FORCED = {
    "now": ({"type": "object", "properties": {}}, lambda arguments: arguments == {}),
    "move": (
        {
            "type": "object",
            "properties": {"unit": {"enum": ["m", "km"]}},
            "required": ["unit"],
            "anyOf": [
                {"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                {"properties": {"y": {"type": "integer"}}, "required": ["y"]},
            ],
        },
        lambda arguments: arguments.get("unit") in ("m", "km") and {"x", "y"} & arguments.keys(),
    ),
}


@pytest.mark.parametrize("name", list(_FORCED))
def test_a_forced_call_ends_with_arguments_of_its_schema(server_url, name):
    """Closed to unlisted keys where nothing else brings keys in (else SmolLM2 adds keys until
    `max_tokens`); open where `anyOf` does (else no call could be written)."""
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
    parameters, valid = _FORCED[name]
    tool = {"type": "function", "function": {"name": name, "parameters": parameters}}
    out = client.chat.completions.create(
        model="gpt-4o-mini", messages=QUESTION, tools=[tool], max_tokens=120,
        tool_choice={"type": "function", "function": {"name": name}},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "tool_calls", out.choices[0].message
    (call,) = out.choices[0].message.tool_calls
    assert valid(json.loads(call.function.arguments)), call.function.arguments
