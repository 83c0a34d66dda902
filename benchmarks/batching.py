"""Concurrent streams: `mlxkv serve` against `mlx_lm.server`, side by side, on the default model.

Both serve a float32 copy of SmolLM2-135M-Instruct, greedy, with the same OpenBLAS (the peer
preloads it); both run at once, measured in turns (the other idle). Per server and load:
  - aggregate generated tokens/s of N concurrent streams of `--tokens` tokens (N = 1, 4, 8),
    in `--rounds` rounds, each round both servers one after the other;
  - time to the whole answer of a 1-token request, idle and while 4 long streams run;
  - 4 requests sent at once sharing a long system prompt: time to all answers, tokens fed.
Goals (batching issue): at 4 streams >= 2.5x one stream's tokens/s on this CPU and >= 1.0x
mlx_lm.server's under the same load; the 1-token request's p50 during 4 streams under 2x its
idle p50.

First, the device's ceiling: one decode step of mlx-lm's own model on its `BatchKVCache`, with
1, 4 and 8 rows, in this process, no server and no cache policy (pipelined, greedy): what N
streams could give at best over one, measured the same moment as the servers.

    python -m benchmarks.batching [--tokens 128] [--probes 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from benchmarks.serve_agent import blas_env, float32_copy, free_port, start_server
from mlxkv.platform import blas as _blas

LOADS = (1, 4, 8)
BACKGROUND_STREAMS = 4
WINDOW_TOKENS = 4096


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)


def _ask(client: openai.OpenAI, i: int, max_tokens: int) -> int:
    reply = client.chat.completions.create(
        model="default_model",
        messages=[{"role": "user", "content": f"Tell story {i}: a long tale of a cat, day {i}."}],
        max_tokens=max_tokens,
        temperature=0,
        timeout=600,
    )
    return reply.usage.completion_tokens


def throughput(client: openai.OpenAI, streams: int, tokens: int, offset: int) -> float:
    """Generated tokens/s of `streams` concurrent requests (distinct prompts: no shared cache)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        done = list(pool.map(lambda i: _ask(client, offset + i, tokens), range(streams)))
    return sum(done) / (time.perf_counter() - start)


def probe_latencies(client: openai.OpenAI, probes: int, busy: bool, offset: int) -> list[float]:
    """Seconds for a 1-token request, `probes` times in a row, with 4 long streams running
    meanwhile when `busy` (they are sent first, and run until the probes are done)."""
    stop = threading.Event()
    background = []

    def keep_busy(i: int) -> None:
        while not stop.is_set():
            _ask(client, offset + 1000 + i, 256)

    if busy:
        background = [threading.Thread(target=keep_busy, args=(i,)) for i in range(4)]
        for thread in background:
            thread.start()
        time.sleep(3.0)  # the streams past their prefill, decoding
    seconds = []
    for n in range(probes):
        start = time.perf_counter()
        _ask(client, offset + n, 1)
        seconds.append(time.perf_counter() - start)
    stop.set()
    for thread in background:
        thread.join()
    return seconds


def shared_system_prompt(client: openai.OpenAI, streams: int, offset: int) -> tuple[float, int]:
    """`streams` requests sent at once with one long system prompt (about 1,000 tokens, as
    parallel sub-agents of a coding agent send) and their own short questions, 8 tokens
    each: seconds until all are answered, and the prompt tokens the server fed (not reused)."""
    rules = " ".join(
        f"Rule {offset}.{i}: keep the cache warm and answers short." for i in range(80)
    )

    def ask(i: int) -> int:
        reply = client.chat.completions.create(
            model="default_model",
            messages=[{"role": "system", "content": rules},
                      {"role": "user", "content": f"Question {i}: what is rule {offset}.{i}?"}],
            max_tokens=8, temperature=0, timeout=600,
        )  # fmt: skip
        details = reply.usage.prompt_tokens_details
        return reply.usage.prompt_tokens - ((details and details.cached_tokens) or 0)

    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        fed = sum(pool.map(ask, range(streams)))
    return time.perf_counter() - start, fed


def ceiling(model_path: Path, steps: int = 48) -> dict[int, float]:
    """Decode steps per second of mlx-lm's model on a `BatchKVCache` of N rows (a 64-token
    context each), pipelined as a server decodes: the step after is queued before one is
    read back."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import BatchKVCache

    model, _ = load(str(model_path))
    rates = {}
    for rows in LOADS:
        cache = [BatchKVCache([0] * rows) for _ in model.layers]
        mx.eval(model(mx.ones((rows, 64), dtype=mx.uint32), cache=cache))

        def step(tokens, cache=cache):
            picked = mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1)[:, None]
            mx.async_eval(picked)
            return picked

        tokens = step(mx.ones((rows, 1), dtype=mx.uint32))
        start = None
        for n in range(steps + 8):
            if n == 8:
                start = time.perf_counter()  # after a few steps of warm-up
            following = step(tokens)
            tokens.tolist()
            tokens = following
        rates[rows] = steps / (time.perf_counter() - start)
    return rates


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--probes", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="mlxkv-batching-"))
    model = float32_copy(work)
    print(f"model: {model.name}; blas: {_blas.blas_in_use}", flush=True)
    servers = {
        "mlxkv serve": [sys.executable, "-m", "mlxkv.cli", "serve", "-m", str(model),
                        "--max-context", str(WINDOW_TOKENS), "--no-cache-dir", "--port"],
        "mlx_lm.server": [sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
                          "--log-level", "WARNING", "--port"],
    }  # fmt: skip
    steps_per_s = ceiling(model)
    print("ceiling, decode steps/s by rows:", steps_per_s, flush=True)
    env = blas_env()
    processes, clients = [], {}
    try:
        for offset, (name, command) in enumerate(servers.items()):
            port = free_port()
            processes.append(start_server([*command, str(port)], port, env, work / f"{offset}.log"))
            clients[name] = _client(port)
            _ask(clients[name], -1, 8)  # warm
        # In turns, a round at a time (the other server idle): drift in the machine's speed
        # from one minute to the next hits both alike; the medians of the rounds are reported.
        rates = {name: {n: [] for n in LOADS} for name in clients}  # tokens/s per round
        for round_ in range(args.rounds):
            for offset, (name, client) in enumerate(clients.items()):
                for n in LOADS:
                    prompt = 1000 * round_ + 100 * offset + 10 * n
                    rates[name][n].append(throughput(client, n, args.tokens, prompt))
            print(f"round {round_ + 1}:", rates, flush=True)
        results: dict[str, dict[str, object]] = {}
        for offset, (name, client) in enumerate(clients.items()):
            idle = probe_latencies(client, args.probes, False, 500 + 100 * offset)
            busy = probe_latencies(client, args.probes, True, 700 + 100 * offset)
            shared = shared_system_prompt(client, BACKGROUND_STREAMS, 900 + 100 * offset)
            results[name] = {"idle": idle, "busy": busy, "shared": shared}
            print(name, results[name], flush=True)
    finally:
        for process in processes:
            process.terminate()
            process.wait(30)
    ours, peer = rates["mlxkv serve"], rates["mlx_lm.server"]
    print(f"\n{args.tokens}-token streams, aggregate generated tokens/s (median of {args.rounds}")
    print("rounds; mlxkv / mlx_lm: the median of each round's ratio):")
    print("streams | mlxkv serve | vs 1 stream | mlx_lm.server | mlxkv / mlx_lm (rounds)")
    for n in LOADS:
        a, b = statistics.median(ours[n]), statistics.median(peer[n])
        each = [x / y for x, y in zip(ours[n], peer[n], strict=True)]
        rounds = ", ".join(f"{r:.2f}" for r in each)
        print(
            f"{n:7d} | {a:11.1f} | {a / statistics.median(ours[1]):10.2f}x | {b:13.1f} | "
            f"{statistics.median(each):.2f}x ({rounds})"
        )
    print("\nThe device's ceiling (mlx-lm's model on BatchKVCache, in process, no server):")
    for n in LOADS:
        rate = n * steps_per_s[n]
        print(f"{n} rows: {rate:.1f} tokens/s, {rate / steps_per_s[1]:.2f}x one row")
    print("\n1-token request, seconds (p50 / p99): idle, during 4 streams, ratio of p50s")
    for name, result in results.items():
        idle, busy = result["idle"], result["busy"]
        ratio = statistics.median(busy) / statistics.median(idle)
        print(
            f"{name}: {_p(idle, 0.5):.2f} / {_p(idle, 0.99):.2f}, "
            f"{_p(busy, 0.5):.2f} / {_p(busy, 0.99):.2f}, {ratio:.2f}x"
        )
    print(f"\n{BACKGROUND_STREAMS} requests at once sharing a 1,000-token system prompt:")
    for name, result in results.items():
        seconds, fed = result["shared"]
        print(f"{name}: all answered in {seconds:.2f} s; prompt tokens fed {fed} (as reported)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
