"""An agent-like replay over HTTP: `mlxkv serve` vs `mlx_lm.server` vs the in-process Runner.

A system prompt of about 1,500 tokens holding tool definitions, then 10 turns that each add
the model's reply and a tool result of about 200 tokens, sent through the `openai` client with
streaming; time to first token (first non-empty content) per turn. Both servers load the same
float32 copy of the default model (SmolLM2-135M-Instruct) and run greedy. mlx_lm.server runs in
its own process, so it gets the same OpenBLAS through LD_PRELOAD (without it MLX's reference
BLAS makes the comparison about 20x in our favour, and worthless).

mlxkv serve runs twice: as it starts by default (on the CPU backend each prefill chunk is
spread over the cores, see `mlxkv.decoding.prefill.lanes`) and with MLXKV_PREFILL_LANES=1 (one
CPU stream, as mlx_lm.server computes), which separates what the cache saves from what the
second core adds. Every reply is compared with mlx_lm.server's in the same round and turn.

The servers run at once (idle while another is measured); each round replays the session
once per configuration, one after the other, with a new task per round (the system prompt is
shared, as an agent's is, so after the first round it is cached everywhere). Figures are
medians over the rounds. Targets: turn-10 TTFT of
mlxkv <= 0.9x mlx_lm.server's; mlxkv over HTTP within 5% of the in-process Runner (total).
Prints Markdown tables and writes JSON.

    python -m benchmarks.serve_agent [--reps 3] [--turns 10] [--reply-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai

from benchmarks.common import filler_text
from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.platform import blas as _blas

_START_TIMEOUT_S = 300
REFERENCE = "mlx_lm.server"  # whose replies the others' are compared with
ONE_LANE = "mlxkv serve, 1 lane"  # prefill on one CPU stream, as mlx_lm.server's
SYSTEM_TOKENS = 1500
RESULT_TOKENS = 200

Stream = Callable[[list[dict]], Iterator[str]]  # messages -> text pieces, streamed


def float32_copy(work: Path) -> Path:
    """The default model's weights as float32 in a directory both servers can load."""
    import mlx.core as mx

    source = load_model(None).path
    out = work / "smollm2-f32"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    weights = {
        k: v.astype(mx.float32) for k, v in mx.load(str(source / "model.safetensors")).items()
    }
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def _tokens(runner: Runner, text: str) -> int:
    return len(runner.tokenizer.encode(text, add_special_tokens=False))


def _sized(runner: Runner, make: Callable[[int], str], target_tokens: int) -> str:
    """The first of make(1), make(2), ... with at least `target_tokens` tokens."""
    size = 1
    while _tokens(runner, text := make(size)) < target_tokens:
        size += 1
    return text


def system_prompt(runner: Runner) -> str:
    def tools(count: int) -> str:
        definitions = [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}",
                    "description": filler_text(24, seed=i),
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "path": {"type": "string", "description": filler_text(8, seed=-i)},
                            "limit": {"type": "integer"},
                        },
                        "required": ["path"],
                    },
                },
            }
            for i in range(count)
        ]
        return (
            "You are a coding agent. Call a tool by answering with its name and JSON arguments."
            "\nTools:\n" + "\n".join(json.dumps(d) for d in definitions)
        )

    return _sized(runner, tools, SYSTEM_TOKENS)


def tool_result(runner: Runner, turn: int, rep: int) -> str:
    return _sized(
        runner,
        lambda words: f"Result: {filler_text(words * 10, seed=rep * 100 + turn)}",
        RESULT_TOKENS,
    )


def replay(
    stream: Stream, system: str, results: list[str], task: str
) -> tuple[list[float], list[str]]:
    """TTFT per turn, in seconds, and the replies; each turn appends the reply and the next
    tool result."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    ttfts, replies = [], []
    for result in results:
        start = time.perf_counter()
        first, reply = None, []
        for piece in stream(messages):
            if piece and first is None:
                first = time.perf_counter() - start
            reply.append(piece)
        ttfts.append(first if first is not None else time.perf_counter() - start)
        replies.append("".join(reply))
        messages += [
            {"role": "assistant", "content": "".join(reply)},
            {"role": "tool", "content": result},
        ]
    return ttfts, replies


def http_stream(url: str, reply_tokens: int) -> Stream:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

    def stream(messages: list[dict]) -> Iterator[str]:
        for chunk in client.chat.completions.create(
            model="default_model",  # mlx_lm.server: the model it was started with
            messages=messages,
            max_tokens=reply_tokens,
            temperature=0.0,
            stream=True,
        ):
            if chunk.choices:
                yield chunk.choices[0].delta.content or ""

    return stream


def runner_stream(runner: Runner, reply_tokens: int) -> Stream:
    def stream(messages: list[dict]) -> Iterator[str]:
        for chunk in runner.stream(messages, max_tokens=reply_tokens):
            yield chunk.text

    return stream


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    command: list[str], port: int, env: dict[str, str] | None, log: Path | None = None
) -> subprocess.Popen:
    """Starts a server and waits until it answers /v1/models; its stderr goes to `log` when
    given (a server logging a line per request would fill a pipe and stall)."""
    stderr = open(log, "w") if log is not None else subprocess.PIPE  # noqa: SIM115
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True
    )
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = process.stderr.read() if log is None else log.read_text()
            raise RuntimeError(f"{command[2]} exited: {said[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{command} did not start in {_START_TIMEOUT_S} s")


def blas_env() -> dict[str, str]:
    """The environment for a peer process: the OpenBLAS mlxkv loaded, preloaded."""
    library = _blas.blas_in_use.removeprefix("OpenBLAS (").removesuffix(")")
    if not Path(library).exists():
        sys.exit(f"OpenBLAS is not in use ({_blas.blas_in_use}); install it first")
    return {**os.environ, "LD_PRELOAD": library}


def measure(
    streams: dict[str, Stream], system: str, runner: Runner, args
) -> tuple[dict[str, list[list[float]]], dict[str, int]]:
    """Replays in turns (each configuration once per round, so drift in the machine's speed
    hits all of them alike); one replay per configuration and round.

    Returns:
        TTFTs per configuration, round and turn; per configuration, how many replies differ
        from mlx_lm.server's in the same round and turn.
    """
    runs: dict[str, list[list[float]]] = {name: [] for name in streams}
    differing = dict.fromkeys(streams, 0)
    for rep in range(args.reps):
        results = [tool_result(runner, turn, rep) for turn in range(args.turns)]
        task = f"Task {rep}: {filler_text(30, seed=1000 + rep)}"
        replies = {}
        for name, stream in streams.items():
            ttfts, replies[name] = replay(stream, system, results, task)
            runs[name].append(ttfts)
            print(f"  {name} replay {rep + 1}: total TTFT {sum(ttfts):.3f} s", flush=True)
        for name in streams:
            pairs = zip(replies[name], replies[REFERENCE], strict=True)
            differing[name] += sum(mine != theirs for mine, theirs in pairs)
    return runs, differing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="mlxkv-bench-"))
    model = float32_copy(work)
    runner = Runner.load(model, max_context=8192)
    system = system_prompt(runner)
    print(f"system prompt: {_tokens(runner, system)} tokens; blas: {_blas.blas_in_use}", flush=True)
    env = blas_env()
    serve = [sys.executable, "-m", "mlxkv.cli", "serve", "-m", str(model), "--max-context", "8192"]
    servers = {
        "mlxkv serve": [*serve, "--port"],
        ONE_LANE: [*serve, "--port"],
        "mlx_lm.server": [
            sys.executable,
            "-m",
            "mlx_lm",
            "server",
            "--model",
            str(model),
            "--log-level",
            "WARNING",
            "--port",
        ],
    }
    processes, streams = [], {}
    try:
        for name, command in servers.items():
            port = free_port()
            lanes = {"MLXKV_PREFILL_LANES": "1"} if name == ONE_LANE else {}
            processes.append(start_server([*command, str(port)], port, {**env, **lanes}))
            streams[name] = http_stream(f"http://127.0.0.1:{port}", args.reply_tokens)
        streams["Runner (in process)"] = runner_stream(runner, args.reply_tokens)
        runs, differing = measure(streams, system, runner, args)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=60)
    report(runs, differing, args)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def report(runs: dict[str, list[list[float]]], differing: dict[str, int], args) -> None:
    medians = {
        name: [statistics.median(rep[t] for rep in reps) for t in range(args.turns)]
        for name, reps in runs.items()
    }
    totals = {name: statistics.median(sum(rep) for rep in reps) for name, reps in runs.items()}
    names = list(runs)
    print(f"\nTTFT per turn, s (median of {args.reps} replays)\n")
    print("| turn | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for t in range(args.turns):
        print(f"| {t + 1} | " + " | ".join(f"{medians[n][t]:.3f}" for n in names) + " |")
    print("| total | " + " | ".join(f"{totals[n]:.3f}" for n in names) + " |")
    replies = args.reps * args.turns
    print(
        f"| replies unlike {REFERENCE}'s | "
        + " | ".join(f"{differing[n]} of {replies}" for n in names)
        + " |"
    )
    last_ratio = medians["mlxkv serve"][-1] / medians["mlx_lm.server"][-1]
    http_ratio = totals["mlxkv serve"] / totals["Runner (in process)"]
    one_lane_ratio = medians[ONE_LANE][-1] / medians["mlx_lm.server"][-1]
    checks = [
        ("turn-10 TTFT, mlxkv / mlx_lm.server", last_ratio, last_ratio <= 0.9, "<= 0.90"),
        ("turn-10 TTFT, mlxkv 1 lane / mlx_lm.server", one_lane_ratio, None, "-"),
        ("total TTFT, mlxkv HTTP / in-process", http_ratio, http_ratio <= 1.05, "<= 1.05"),
    ]
    print("\n| target | ratio | goal | result |\n|---|---|---|---|")
    for label, ratio, ok, goal in checks:
        verdict = "-" if ok is None else "PASS" if ok else "FAIL"
        print(f"| {label} | {ratio:.2f} | {goal} | {verdict} |")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "reps": args.reps,
        "turns": args.turns,
        "reply_tokens": args.reply_tokens,
        "ttft_s": runs,
        "median_ttft_s": medians,
        "total_ttft_s": totals,
        "replies_unlike_mlx_lm_server": differing,
        "ratios": {label: ratio for label, ratio, _, _ in checks},
    }
    (args.out / "serve_agent.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
