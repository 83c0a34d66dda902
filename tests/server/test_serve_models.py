"""`mlxkv serve` with several `-m`: each model by its name (`NAME=MODEL` or the directory's
name), `--alias` patterns, a 404 naming the served models for any other name, and every
model's cache saved on the way out."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import ollama
import openai
import pytest

from tests.factories import tiny_model_dir
from tests.processes import ready_url

ROOT = Path(__file__).resolve().parents[2]
_TIMEOUT_S = 120


def test_two_models_by_name_and_alias_each_with_its_cache(model_root, tmp_path):
    llama, qwen = tiny_model_dir("llama", model_root), tiny_model_dir("qwen3", model_root)
    args = ["-m", str(llama), "-m", f"coder={qwen}", "--alias", "claude-*=coder"]
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxkv.cli", "serve", *args, "--port", "0",
         "--cache-dir", str(tmp_path), "--no-warmup"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    try:
        url = ready_url(process, _TIMEOUT_S)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert sorted(m.id for m in client.models.list()) == sorted([llama.name, "coder"])
        ask = [{"role": "user", "content": "Hello"}]
        for name in (llama.name, "coder", "claude-sonnet-5"):
            reply = client.chat.completions.create(model=name, max_tokens=3, messages=ask)
            want = "coder" if name.startswith("claude") else name
            assert reply.model == want
        with pytest.raises(openai.NotFoundError, match="coder"):
            client.chat.completions.create(model="gpt-x", max_tokens=3, messages=ask)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "Traceback" not in stderr
    assert len(list(tmp_path.glob("*/*.safetensors"))) >= 2, stderr  # each model's own tier


def test_a_models_dir_is_listed_and_each_loads_on_its_first_request(model_root, tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    for arch in ("llama", "qwen3"):
        (folder / arch).symlink_to(tiny_model_dir(arch, model_root), target_is_directory=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxkv.cli", "serve", "--models-dir", str(folder), "--port", "0",
         "--cache-dir", str(tmp_path / "kv"), "--no-warmup"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    try:
        url = ready_url(process, _TIMEOUT_S)
        client = ollama.Client(host=url)
        assert [m.model for m in client.list().models] == ["llama:latest", "qwen3:latest"]
        assert client.ps().models == []
        for name in ("llama", "qwen3"):
            assert client.generate(model=name, prompt="Hi", options={"num_predict": 2}).done
        assert sorted(m.model for m in client.ps().models) == ["llama:latest", "qwen3:latest"]
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "Traceback" not in stderr
    assert "loaded model=llama" in stderr and "loads on its first request" in stderr
    assert len(list((tmp_path / "kv").glob("*/*.safetensors"))) >= 2, stderr  # saved at exit


@pytest.fixture
def closes(monkeypatch):
    """Counts the Runners closed (their caches saved) by `mlxkv serve` in this process."""
    from mlxkv.runner.runner import Runner

    closed = []
    close = Runner.close
    monkeypatch.setattr(Runner, "close", lambda self, **kw: closed.append(close(self, **kw)))
    return closed


def test_a_bad_alias_still_saves_the_loaded_models_cache(model_root, tmp_path, closes):
    from mlxkv.cli import main

    model = str(tiny_model_dir("llama", model_root))
    status = main(["serve", "-m", model, "--alias", "claude-*=nope", "--port", "0",
                   "--cache-dir", str(tmp_path), "--no-warmup"])  # fmt: skip
    assert status == 2 and len(closes) == 1


def test_an_address_in_use_still_saves_the_loaded_models_cache(model_root, tmp_path, closes):
    from mlxkv.cli import main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = str(taken.getsockname()[1])
        model = str(tiny_model_dir("llama", model_root))
        status = main(["serve", "-m", model, "--port", port, "--cache-dir", str(tmp_path),
                       "--no-warmup"])  # fmt: skip
    finally:
        taken.close()
    assert status == 1 and len(closes) == 1


@pytest.mark.parametrize(
    ("given", "seconds"), [("10m", 600.0), ("90", 90.0), ("0", 0.0), ("-1", -1.0), ("-5m", -1.0)]
)
@pytest.mark.parametrize("joined", [True, False], ids=["equals", "apart"])
def test_keep_alive_is_read_as_ollama_reads_it(given, seconds, joined):
    from mlxkv.cli.parser import build_parser

    option = [f"--keep-alive={given}"] if joined else ["--keep-alive", given]  # "-5m" too
    args = build_parser().parse_args(["serve", *option, "--max-memory", "2GiB"])
    assert args.keep_alive == seconds and args.max_memory == "2GiB"


def test_a_keep_alive_ollama_refuses_is_a_usage_error(capsys):
    from mlxkv.cli.parser import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--keep-alive", "5 m"])
    assert 'unknown unit " m"' in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["small=", "small= "], ids=["empty", "blank"])
def test_a_name_given_no_model_is_refused_at_start(spec):
    """`-m small=` started a server that listed `small` and failed on its first request."""
    from mlxkv.cli.serve import _named_models

    with pytest.raises(SystemExit, match="names no model; give one: -m small=MODEL"):
        _named_models([spec], [])
