"""`mlxkv serve` under a mixed, partly hostile load, for a fixed time, on 127.0.0.1.

Clients, each a thread with a bounded count and the same deadline: normal ones (streamed chat
requests of 16 tokens, time to first token measured), slow readers (ask for 512 tokens and
read nothing), disconnectors (read up to the first text and hang up), oversized bodies (over
--max-body-bytes), malformed JSON, and idle sockets that send nothing. The server's resident
memory is sampled throughout. Targets (issue: the server under attack): normal clients are
never starved (p99 time to first token within a few seconds), resident memory stays under the
cache budget plus a stated overhead, every failure is the error its kind should get.

    python -m benchmarks.load_test [--seconds 30] [--model DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.serve_agent import free_port, start_server

MAX_BODY_BYTES = 2**20
QUESTION = [{"role": "user", "content": "Name three rivers and one museum, briefly."}]


class Load:
    """What the clients saw: TTFTs of the normal requests, outcomes by kind."""

    def __init__(self, url: str, deadline: float):
        self.url, self.deadline = url, deadline
        self.ttfts: list[float] = []
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def note(self, kind: str, outcome: str, ttft: float | None = None) -> None:
        with self.lock:
            self.outcomes[f"{kind}: {outcome}"] += 1
            if ttft is not None:
                self.ttfts.append(ttft)

    def running(self) -> bool:
        return time.monotonic() < self.deadline


def _post(url: str, body: bytes, timeout_s: float = 120) -> urllib.request.Request:
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, method="POST")
    request.add_header("Content-Type", "application/json")
    return urllib.request.urlopen(request, timeout=timeout_s)


def _client(load: Load, kind: str, attempt, pause_s: float = 0.0) -> None:
    """Repeats `attempt()` (-> outcome, seconds to the first text or None) until the deadline,
    noting each outcome; on 429 it waits as long as Retry-After says, as real clients do."""
    while load.running():
        try:
            outcome, ttft = attempt()
            load.note(kind, outcome, ttft)
        except urllib.error.HTTPError as error:
            load.note(kind, f"HTTP {error.code}")
            if error.code == 429:
                time.sleep(float(error.headers.get("Retry-After", "1")))
        except OSError as error:
            load.note(kind, type(error).__name__)
        time.sleep(pause_s)


def _has_text(line: bytes) -> bool:
    """An SSE line carrying generated text."""
    if not line.startswith(b"data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


def _stream_body(max_tokens: int) -> bytes:
    return json.dumps({"messages": QUESTION, "max_tokens": max_tokens, "stream": True}).encode()


def normal(load: Load) -> None:
    def attempt():
        start, first = time.perf_counter(), None
        with _post(load.url, _stream_body(16)) as response:
            for line in response:
                if first is None and _has_text(line):
                    first = time.perf_counter() - start
        return "ok", first

    _client(load, "normal", attempt)


def slow_reader(load: Load) -> None:
    def attempt():
        response = _post(load.url, _stream_body(512))
        while load.running():  # holds the connection, reads nothing
            time.sleep(0.5)
        response.close()
        return "held to the end", None

    _client(load, "slow reader", attempt)


def disconnector(load: Load) -> None:
    def attempt():
        with _post(load.url, _stream_body(256)) as response:
            for line in response:  # leaves mid-answer, at its first text
                if _has_text(line):
                    break
        return "left at the first text", None

    _client(load, "disconnector", attempt)


def oversized(load: Load) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 * MAX_BODY_BYTES)}]})

    def attempt():
        _post(load.url, big.encode()).close()
        return "accepted (wrong)", None

    _client(load, "oversized", attempt, pause_s=0.2)


def malformed(load: Load) -> None:
    def attempt():
        _post(load.url, b'{"messages": [').close()
        return "accepted (wrong)", None

    _client(load, "malformed", attempt, pause_s=0.2)


def idle_sockets(load: Load, count: int) -> None:
    port = int(load.url.rsplit(":", 1)[1])
    held = []
    for _ in range(count):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError as error:
            load.note("idle socket", type(error).__name__)
    closed = 0
    while load.running():
        time.sleep(0.5)
    for sock in held:
        sock.setblocking(False)
        try:
            closed += sock.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        sock.close()
    load.note("idle socket", f"{closed} of {len(held)} closed by the server", None)


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--normal", type=int, default=4, help="normal clients")
    parser.add_argument("--hostile", type=int, default=2, help="clients of each hostile kind")
    parser.add_argument("--idle-sockets", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [sys.executable, "-m", "mlxkv.cli", "serve", "--port", str(port),
               "--no-cache-dir", "--max-body-bytes", str(MAX_BODY_BYTES)]  # fmt: skip
    if args.model:
        command += ["-m", args.model]
    log = args.out / "load_test.log"
    server = start_server(command, port, env=None, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        load = Load(url, time.monotonic() + args.seconds)
        workers = [threading.Thread(target=normal, args=(load,)) for _ in range(args.normal)]
        for kind in (slow_reader, disconnector, oversized, malformed):
            workers += [threading.Thread(target=kind, args=(load,)) for _ in range(args.hostile)]
        workers.append(threading.Thread(target=idle_sockets, args=(load, args.idle_sockets)))
        rss = [resident_bytes(server.pid)]
        for worker in workers:
            worker.start()
        while load.running():
            time.sleep(1)
            rss.append(resident_bytes(server.pid))
        for worker in workers:
            worker.join(timeout=180)
        rss.append(resident_bytes(server.pid))
    finally:
        server.terminate()
        server.wait(timeout=60)
    report(load, rss, args, log)
    return 0


def report(load: Load, rss: list[int], args: argparse.Namespace, log: Path) -> None:
    ttfts = sorted(load.ttfts)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan")
    print(f"## mlxkv serve under load ({args.seconds:.0f} s, {args.normal} normal clients, "
          f"{args.hostile} of each hostile kind, {args.idle_sockets} idle sockets)\n")  # fmt: skip
    print("| measure | value |\n|---|---|")
    print(f"| normal requests answered | {len(ttfts)} |")
    if ttfts:
        print(f"| normal TTFT p50 / p99 (s) | {statistics.median(ttfts):.3f} / {p99:.3f} |")
    print(f"| server RSS start / peak / end (MiB) | {rss[0] / 2**20:.0f} / "
          f"{max(rss) / 2**20:.0f} / {rss[-1] / 2**20:.0f} |")  # fmt: skip
    print("\n| client: outcome | count |\n|---|---|")
    for outcome, count in sorted(load.outcomes.items()):
        print(f"| {outcome} | {count} |")
    lines = log.read_text().splitlines()
    tracebacks = sum("Traceback" in line for line in lines)
    print(f"\nserver log: {len(lines)} lines, {tracebacks} tracebacks ({log})")
    summary = {"ttfts_s": ttfts, "rss_bytes": rss, "outcomes": dict(load.outcomes)}
    (args.out / "load_test.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
