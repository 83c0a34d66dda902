"""Real coding-agent sessions replayed against `mlxkv serve` and `mlx_lm.server`, side by side.

`record` runs the agents people use (Claude Code, Codex CLI) headless against an in-process
mlxkv server and keeps every request body they send, as JSON lines, in `benchmarks/fixtures/`
(a few turns each: the first prompt, `--continue` / `resume --last`). The agents' prompts do
not fit the default model's 8,192-token window, so the server runs a factory llama with a
64k window (its replies are noise; what matters is the requests they lead to).
`replay` sends each session's bodies in order, streamed: to `mlxkv serve` as the agent sent
them (Anthropic Messages, OpenAI Responses), and to `mlx_lm.server` as the equivalent chat
completion (the same messages and tools, converted by mlxkv's own request models, so both
render the same prompt). Both serve the same model (a 100M-parameter factory llama with a
64k window, float32), greedy, with the same OpenBLAS (LD_PRELOAD for the peer). Reported
per turn: time to the first streamed event that carries text or a tool call, and the prompt
tokens each server reports as cached.
Goals (coding-agents issue): every turn after the first costs only its new tokens, and turn
TTFT <= 0.6x mlx_lm.server's.

    python -m benchmarks.agent_replay record [--agent claude|codex]
    python -m benchmarks.agent_replay replay [--reps 1]   (a round takes ~9 min on 2 cores)
        [--size tiny]   (a 2-layer llama of width 64: compute costs next to nothing, what is
                         left is each server's host work; ~1 min a round)
        [--resend]      (each request sent twice in a row, the second all cached)
        [--before DIR]  (another checkout's mlxkv serve beside this tree's, e.g. main's)
        [--app]         (each tree's app also under plain uvicorn, without the CLI)
        [--again N]     (then the session's last request N more times, all cached but one
                         token: each server's median [min] over the N, a cached turn's
                         host time with more samples than the rounds give)
    Each request goes to every server in turn, `--gap-s` (0.2) apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.serve_agent import blas_env, free_port, start_server

FIXTURES = Path(__file__).parent / "fixtures"
SESSIONS = {
    "claude": (FIXTURES / "claude_code_session.jsonl", "/v1/messages"),
    "codex": (FIXTURES / "codex_session.jsonl", "/v1/responses"),
}
TURNS = ("List the files in this folder.", "And which one is the largest?", "Thanks.")
REPLY_TOKENS = 32
WINDOW_TOKENS = 65536
PEER = "mlx_lm.server"
_AGENT_TIMEOUT_S = 600


# -- record ---------------------------------------------------------------------------------


class _Recorder:
    """ASGI middleware keeping the JSON body of every generation request, in order."""

    def __init__(self, app: Any, path: Path, api_path: str):
        self.app, self.path, self.api_path = app, path, api_path
        self.lock = threading.Lock()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != self.api_path:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        with self.lock, self.path.open("a") as out:
            out.write(json.dumps(json.loads(body)) + "\n")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def record(agent: str) -> None:
    import uvicorn

    from mlxkv import Runner
    from mlxkv.server import create_app

    path, api_path = SESSIONS[agent]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mlxkv-record-"))
    runner = Runner.load(long_window_model(work, "tiny"), max_context=WINDOW_TOKENS)
    port = free_port()
    app = _Recorder(create_app(runner), path, api_path)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as home:
        work = Path(home) / "project"
        work.mkdir()
        for name, size in (("notes.txt", 200), ("main.py", 1200), ("data.csv", 5000)):
            (work / name).write_text("x" * size)
        for turn, text in enumerate(TURNS):
            command, env = _agent_command(agent, url, Path(home), first=turn == 0)
            subprocess.run([*command, text], env={**os.environ, **env}, cwd=work, check=True,
                           capture_output=True, timeout=_AGENT_TIMEOUT_S)  # fmt: skip
    server.should_exit = True
    thread.join(timeout=60)
    shutil.rmtree(work, ignore_errors=True)
    print(f"recorded {sum(1 for _ in path.open())} requests to {path}")


def long_window_model(work: Path, size: str) -> Path:
    """A factory llama whose window holds an agent's prompt."""
    from mlxkv.testing.factory import build_model

    overrides = {"max_position_embeddings": 2 * WINDOW_TOKENS}
    return build_model("llama", work / f"llama-{size}", size=size, config_overrides=overrides)


def _agent_command(agent: str, url: str, home: Path, first: bool) -> tuple[list[str], dict]:
    if agent == "claude":
        env = {
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "unused",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
        }
        return (["claude", "-p"] if first else ["claude", "-p", "--continue"]), env
    codex_home = home / "codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(
        'model = "SmolLM2"\nmodel_provider = "mlxkv"\n[model_providers.mlxkv]\n'
        f'name = "mlxkv"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
    )
    env = {"HOME": str(home), "CODEX_HOME": str(codex_home)}
    command = ["codex", "exec", "--skip-git-repo-check"]
    return (command if first else [*command, "resume", "--last"]), env


# -- replay ---------------------------------------------------------------------------------


def load_session(agent: str) -> list[dict]:
    """The session's requests, without those the agent sent again with a smaller limit (it
    asked for more max_tokens than the window held, got a 400 and retried: replayed with the
    benchmark's own limit, the two would be the same request)."""
    path, _ = SESSIONS[agent]
    bodies = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def without_limit(body: dict) -> dict:
        return {k: v for k, v in body.items() if k not in ("max_tokens", "max_output_tokens")}

    return [
        body
        for body, after in zip(bodies, [*bodies[1:], None], strict=True)
        if after is None or without_limit(body) != without_limit(after)
    ]


def as_chat(agent: str, body: dict) -> dict:
    """The chat-completions body carrying the same messages and tools (mlxkv's converters)."""
    if agent == "claude":
        from mlxkv.server.anthropic_api.protocol import MessagesRequest

        request = MessagesRequest.model_validate(body)
        messages, tools = request.chat_messages(), request.template_tools()
    else:
        from mlxkv.server.responses_api.protocol import ResponsesRequest, chat_messages

        request = ResponsesRequest.model_validate(body)
        messages = chat_messages(request.instructions, request.input_items())
        tools = request.template_tools()
    chat = {"messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if tools:
        chat["tools"] = tools
    return chat


def _as_mlxkv(agent: str, body: dict) -> dict:
    limit = "max_tokens" if agent == "claude" else "max_output_tokens"
    return {**body, limit: REPLY_TOKENS, "temperature": 0.0, "stream": True}


def send(url: str, path: str, body: dict) -> tuple[float, int | None, int | None]:
    """Streams one request: seconds to the first event with text or a tool call, and the
    prompt and cached tokens the server reported (None where it reports none)."""
    request = urllib.request.Request(url + path, json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    start, first, usage = time.perf_counter(), None, {}
    with urllib.request.urlopen(request, timeout=_AGENT_TIMEOUT_S) as response:
        for raw in response:
            if not raw.startswith(b"data: {"):
                continue
            event = json.loads(raw[6:])
            if first is None and _carries_output(event):
                first = time.perf_counter() - start
            usage = _usage(event) or usage
    elapsed = first if first is not None else time.perf_counter() - start
    return elapsed, usage.get("prompt"), usage.get("cached")


def _carries_output(event: dict) -> bool:
    kind = event.get("type", "")
    if kind in ("content_block_start", "response.output_item.added"):
        return True
    if kind in ("content_block_delta", "response.output_text.delta"):
        return True
    delta = (event.get("choices") or [{}])[0].get("delta", {})
    return bool(delta.get("content") or delta.get("tool_calls"))


def _usage(event: dict) -> dict:
    """prompt and cached tokens from any API's usage event."""
    if event.get("type") == "message_delta":
        usage = event["usage"]
        cached = usage.get("cache_read_input_tokens", 0)
        return {"prompt": usage.get("input_tokens", 0) + cached, "cached": cached}
    if event.get("type") in ("response.completed", "response.incomplete"):
        usage = event["response"]["usage"]
        cached = usage["input_tokens_details"]["cached_tokens"]
        return {"prompt": usage["input_tokens"], "cached": cached}
    usage = event.get("usage")
    if usage and "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details") or {}
        return {"prompt": usage["prompt_tokens"], "cached": details.get("cached_tokens")}
    return {}


def replay(args: argparse.Namespace) -> None:
    """Each round starts every server afresh (so every round's first request is cold, as a
    new agent session's is) and sends each request of each session to every server in turn,
    so that a change in the machine's load hits them alike."""
    work = Path(tempfile.mkdtemp(prefix="mlxkv-replay-"))
    model = long_window_model(work, args.size)
    servers = _servers(model, args)
    results = {agent: {name: [] for name in servers} for agent in args.agents}
    again = {agent: {name: [] for name in servers} for agent in args.agents}
    for rep in range(args.reps):
        processes, urls = [], {}
        try:
            for name, (command, env) in servers.items():
                port = free_port()
                log = work / f"{port}.log"
                processes.append(start_server([*command, str(port)], port, env, log))
                urls[name] = f"http://127.0.0.1:{port}"
            for agent in args.agents:
                _, api_path = SESSIONS[agent]
                turns = {name: [] for name in servers}
                for body in load_session(agent):
                    for _ in range(2 if args.resend else 1):
                        for name, url in urls.items():
                            time.sleep(args.gap_s)  # the last server's request ends first
                            turns[name].append(
                                send(url, "/v1/chat/completions", as_chat(agent, body))
                                if name == PEER
                                else send(url, api_path, _as_mlxkv(agent, body))
                            )
                for _ in range(args.again):
                    for name, url in urls.items():
                        time.sleep(args.gap_s)
                        chat = name == PEER
                        last = as_chat(agent, body) if chat else _as_mlxkv(agent, body)
                        sent = send(url, "/v1/chat/completions" if chat else api_path, last)
                        again[agent][name].append(sent[0])
                for name, sent in turns.items():
                    results[agent][name].append(sent)
                    print(f"  round {rep + 1}, {agent}, {name}: {sum(t[0] for t in sent):.2f} s",
                          flush=True)  # fmt: skip
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=60)
    report(results, args)
    if args.again:
        _report_again(again, args.again * args.reps)
    shutil.rmtree(work, ignore_errors=True)


def _report_again(again: dict, count: int) -> None:
    print(
        f"\n## the last request sent again {count} times: time to first token, ms, median [min]\n"
    )
    names = list(next(iter(again.values())))
    print("| agent | " + " | ".join(names) + " |\n" + "|---" * (len(names) + 1) + "|")
    for agent, by_server in again.items():
        cells = [
            f"{1e3 * statistics.median(t):.1f} [{1e3 * min(t):.1f}]" for t in by_server.values()
        ]
        print(f"| {agent} | " + " | ".join(cells) + " |")


def _servers(model: Path, args: argparse.Namespace) -> dict[str, tuple[list[str], dict]]:
    """Each server's command (its port appended) and environment: `mlxkv serve` of this
    tree, of `--before` (another checkout, e.g. main's), each also as the app under plain
    uvicorn without the CLI (`--app`), and mlx_lm.server (last: the ratios' reference)."""
    env = blas_env()
    serve = [sys.executable, "-m", "mlxkv.cli", "serve", "-m", str(model), "--no-cache-dir",
             "--max-context", str(WINDOW_TOKENS), "--port"]  # fmt: skip
    # run as a file: a `--before` checkout first on the path may hold an older copy of this one
    app = [sys.executable, str(Path(__file__).resolve()), "app", str(model), "--port"]
    trees = {"": os.getcwd()} | ({" (before)": str(args.before)} if args.before else {})
    servers = {}
    for suffix, tree in trees.items():
        tree_env = {**env, "PYTHONPATH": os.pathsep.join([tree, os.getcwd()])}
        servers[f"mlxkv serve{suffix}"] = (serve, tree_env)
        if args.app:
            servers[f"app{suffix}"] = (app, tree_env)
    servers[PEER] = ([sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
                      "--log-level", "WARNING", "--port"], env)  # fmt: skip
    return servers


def serve_app(model: str, port: int) -> None:
    """The app in a process of its own under plain uvicorn: no CLI, no logging set up."""
    import uvicorn

    from mlxkv import Runner
    from mlxkv.server import create_app

    runner = Runner.load(model, max_context=WINDOW_TOKENS)
    uvicorn.run(create_app(runner), host="127.0.0.1", port=port, log_level="warning")


def report(results: dict, args: argparse.Namespace) -> None:
    summary = {}
    for agent, by_server in results.items():
        names = list(by_server)
        turns = len(by_server[names[0]][0])
        print(f"\n## {agent}: time to first token, s (median of {args.reps} rounds); "
              "cached/prompt tokens (first round)\n")  # fmt: skip
        others = [name for name in names if name != PEER]
        print("| request | " + " | ".join(names) + " | "
              + " | ".join(f"{name} / {PEER}" for name in others) + " |")  # fmt: skip
        print("|---" * (len(names) + len(others) + 1) + "|")
        for t in range(turns):
            cells, medians = [], []
            for name in names:
                median = statistics.median(rep[t][0] for rep in by_server[name])
                _, prompt, cached = by_server[name][0][t]
                medians.append(median)
                counts = f"{cached}/{prompt}" if prompt is not None else "-"
                cells.append(f"{median:.3f} ({counts})")
            peer = medians[names.index(PEER)]
            ratios = [f"{m / peer:.2f}" for m, n in zip(medians, names, strict=True) if n != PEER]
            label = f"{t // 2 + 1}{' again' if t % 2 else ''}" if args.resend else f"{t + 1}"
            print(f"| {label} | " + " | ".join(cells + ratios) + " |")
        summary[agent] = {name: [list(map(list, rep)) for rep in reps]
                          for name, reps in by_server.items()}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agent_replay.json").write_text(json.dumps(summary, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run the agents against mlxkv, keep their bodies")
    rec.add_argument("--agent", choices=sorted(SESSIONS), action="append")
    rep = commands.add_parser("replay", help="replay the recorded sessions on both servers")
    rep.add_argument("--agents", nargs="+", choices=sorted(SESSIONS), default=sorted(SESSIONS))
    rep.add_argument("--reps", type=int, default=1)
    rep.add_argument("--resend", action="store_true",
                     help="send each request twice in a row (the second all cached: each "
                          "server's host time per turn, with one token to feed)")  # fmt: skip
    rep.add_argument("--size", choices=("100m", "tiny"), default="100m",
                     help="the factory llama's size; tiny: compute costs next to nothing, "
                          "what is left is each server's host (Python) work")  # fmt: skip
    rep.add_argument("--before", type=Path,
                     help="another checkout (e.g. main's) whose mlxkv serve runs beside this "
                          "tree's, as 'mlxkv serve (before)'")  # fmt: skip
    rep.add_argument("--app", action="store_true",
                     help="also the app under plain uvicorn in its own process (no CLI, no "
                          "logging), for each tree")  # fmt: skip
    rep.add_argument("--gap-s", type=float, default=0.2,
                     help="pause before each request, so that the work a server does after "
                          "a reply is not counted in the next server's turn")  # fmt: skip
    rep.add_argument(
        "--again",
        type=int,
        default=0,
        help="then send each session's last request this many more times",
    )
    rep.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    app = commands.add_parser("app", help="(used by replay --app) serve the app on a port")
    app.add_argument("model")
    app.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command == "record":
        for agent in args.agent or sorted(SESSIONS):
            record(agent)
    elif args.command == "app":
        serve_app(args.model, args.port)
    else:
        replay(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
