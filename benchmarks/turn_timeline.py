"""Where a cached agent turn's time goes inside `mlxkv serve`, step by step.

Starts `mlxkv serve` (the tiny 64k-window llama of `agent_replay`) in a process of its own
with a stamp taken at each hand-off of a request (wrappers around the functions named in the
output: HTTP in, the route handing over to the worker, encoding, landmarks, the engine
starting it, the pool's lookup, the first token, the first chunk on each thread, the first
output event written), plays a recorded session, then sends its last request again `--n`
times (all cached but one token) and prints each step's median and the client's time to the
first event. The wrappers add a little work of their own; compare runs of this script only.

    python -m benchmarks.turn_timeline [--agent codex|claude] [--n 30] [--tree DIR]
        (--tree: run another checkout's mlxkv, e.g. main's, for a before/after)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_STAMPS: dict[str, float] | None = None  # the request being stamped (one at a time)


def _stamp(name: str) -> None:
    if _STAMPS is not None and name not in _STAMPS:
        _STAMPS[name] = time.perf_counter()


def _wrap(owner: Any, attribute: str, before: str | None = None, after: str | None = None):
    function = getattr(owner, attribute)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            _stamp(before)
        result = function(*args, **kwargs)
        if after:
            _stamp(after)
        return result

    setattr(owner, attribute, wrapped)


def _stamped_app(create_app: Any, out: Path) -> Any:
    """create_app whose app stamps each POST's arrival and its first output event, and
    appends the request's stamps to `out` once that event is written."""

    def create(*args: Any, **kwargs: Any) -> Any:
        app = create_app(*args, **kwargs)

        async def stamped(scope, receive, send):
            global _STAMPS
            if scope["type"] != "http" or scope["method"] != "POST":
                return await app(scope, receive, send)
            _STAMPS = stamps = {"http in": time.perf_counter()}

            async def sending(message):
                body = message.get("body", b"")
                first = "first event written" not in stamps
                output = b"output_item.added" in body or b"content_block_start" in body
                await send(message)
                if first and output:
                    _stamp("first event written")
                    with out.open("a") as file:
                        file.write(json.dumps(stamps) + "\n")

            return await app(scope, receive, sending)

        return stamped

    return create


def serve(out: Path, argv: list[str]) -> int:
    """`mlxkv serve argv` with the stamps."""
    import mlxkv.server
    import mlxkv.server.app
    from mlxkv.cli import main
    from mlxkv.decoding.picker import TokenPicker
    from mlxkv.runner.prompt_cache.pool import CachePool
    from mlxkv.runner.runner import Runner
    from mlxkv.runner.scheduling.engine import EngineThread, Interleaved
    from mlxkv.runner.text.landmarks import LandmarkFinder
    from mlxkv.runner.text.prompt import PromptEncoder
    from mlxkv.server import worker

    mlxkv.server.create_app = _stamped_app(mlxkv.server.app.create_app, out)
    _wrap(worker.GenerationWorker, "start", before="route hands over to the worker")
    _wrap(Runner, "stream", before="Runner.stream starts", after="request built")
    _wrap(PromptEncoder, "encode", after="prompt encoded")
    _wrap(LandmarkFinder, "find", after="landmarks found")
    _wrap(worker.GenerationStream, "pump", before="the stream's thread starts")
    _wrap(EngineThread, "_submit", before="handed to the engine")
    _wrap(Interleaved, "_advance", before="engine starts it", after="engine's first chunk out")
    _wrap(CachePool, "fetch_nearest", after="pool lookup done")
    _wrap(TokenPicker, "__call__", after="first pick queued")
    _wrap(worker.GenerationStream, "_deliver", before="stream's thread hands it to the loop")
    return main(["serve", *argv])


def measure(args: argparse.Namespace) -> None:
    from benchmarks import agent_replay as replay
    from benchmarks.serve_agent import blas_env, free_port, start_server

    work = Path(tempfile.mkdtemp(prefix="mlxkv-timeline-"))
    model = replay.long_window_model(work, "tiny")
    out = work / "stamps.jsonl"
    port = free_port()
    path = os.pathsep.join([str(args.tree), os.getcwd()]) if args.tree else os.getcwd()
    env = {**blas_env(), "PYTHONPATH": path}
    command = [sys.executable, str(Path(__file__).resolve()), "serve", str(out), "-m",
               str(model), "--no-cache-dir", "--max-context", str(replay.WINDOW_TOKENS), "--port",
               str(port)]  # fmt: skip
    process = start_server(command, port, env, work / "server.log")
    url, (_, api_path) = f"http://127.0.0.1:{port}", replay.SESSIONS[args.agent]
    bodies = [replay._as_mlxkv(args.agent, body) for body in replay.load_session(args.agent)]
    try:
        for body in bodies:
            replay.send(url, api_path, body)
        out.unlink(missing_ok=True)
        client = [replay.send(url, api_path, bodies[-1])[0] for _ in range(args.n)]
    finally:
        process.terminate()
        process.wait(timeout=60)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    medians = {
        name: statistics.median(row[name] - row["http in"] for row in rows if name in row)
        for name in {name for row in rows for name in row}
    }
    print(f"{args.agent}, last request sent again {args.n} times: median ms since HTTP in\n")
    print("| step | ms since HTTP in | ms since the step before |\n|---|---|---|")
    last = 0.0
    for name, seconds in sorted(medians.items(), key=lambda item: item[1]):
        print(f"| {name} | {1e3 * seconds:.2f} | {1e3 * (seconds - last):.2f} |")
        last = seconds
    print(f"| the client's first event | {1e3 * statistics.median(client):.2f} | |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the server's process
        return serve(Path(argv[1]), argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", choices=("claude", "codex"), default="codex")
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--tree", type=Path, help="another checkout whose mlxkv serve runs")
    measure(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
