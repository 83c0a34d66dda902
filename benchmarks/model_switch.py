"""Switching between two models served by one server, loaded on demand.

Two models (the bundled SmolLM2-135M and a ~100M-parameter factory llama) behind one app, each
a `ModelLoader`; streamed chat requests through the `openai` client, each with a new prompt of
about `--prompt-tokens` tokens (no cache hit: what is measured is loading, not reuse), one token
generated; time to first token (TTFT, client side). Scenarios, each on a fresh server:

- cold: the first request to each model (its load, then its prefill);
- one model: requests to one model, loaded, on a server that serves only it (the baseline);
- both fit: requests alternating between the two models, both loaded (no budget): the goal is
  no extra cost over the one-model server;
- budget of one: `max_memory_bytes` holds one model, so each request unloads the other (its
  cache written to its disk tier) and loads its own: compared with the cold start.

Medians over `--reps` requests per model. Prints a Markdown table.

    python -m benchmarks.model_switch [--reps 4] [--prompt-tokens 200]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from benchmarks.common import filler_text
from mlxkv import Runner
from mlxkv.config import RunnerConfig, ServerConfig
from mlxkv.models.loading import load_model
from mlxkv.server import create_app
from mlxkv.server.connections import Server, uvicorn_config
from mlxkv.server.models.model import ModelLoader
from mlxkv.testing.factory import build_model

CACHE_BYTES = 256 * 2**20


def model_paths(work: Path) -> dict[str, Path]:
    factory = work / "factory-100m"
    if not (factory / "config.json").exists():
        build_model("llama", factory, size="100m", vocab_size=512)
    return {"smollm2": load_model(None).path, "factory-100m": factory}


def loaders(paths: dict[str, Path], cache_dir: Path) -> dict[str, ModelLoader]:
    def loader(path: Path) -> ModelLoader:
        config = RunnerConfig.for_server(cache_dir=cache_dir, cache_bytes=CACHE_BYTES)
        return ModelLoader(lambda: Runner.load(str(path), config))

    return {name: loader(path) for name, path in paths.items()}


@contextmanager
def serving(sources: dict, **options) -> Iterator[tuple[openai.OpenAI, object]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = ServerConfig.of(None, options)
    app = create_app(sources, config)
    server = Server(uvicorn_config(app, config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "server did not start"
        time.sleep(0.02)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="x", max_retries=0
    )
    try:
        yield client, app
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


_counter = iter(range(10**6))


def ttft_s(client: openai.OpenAI, model: str, prompt_tokens: int) -> float:
    """One streamed request with a prompt not seen before; seconds to its first token."""
    text = filler_text(prompt_tokens * 3 // 4, seed=next(_counter))
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=1,
        temperature=0,
        stream=True,
    )
    first = None
    for chunk in stream:  # the first chunk is the role alone, sent before the prefill
        delta = chunk.choices[0] if chunk.choices else None
        if delta is not None and (delta.delta.content or delta.finish_reason):
            first = first or time.perf_counter()
    return (first or time.perf_counter()) - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        paths = model_paths(work)
        names = list(paths)
        results: dict[str, dict[str, float]] = {}

        with serving(loaders(paths, work / "kv")) as (client, app):
            results["cold (first request: load + prefill)"] = {
                name: ttft_s(client, name, args.prompt_tokens) for name in names
            }
            footprints = {
                m.name: m.footprint_bytes for m in app.state.mlxkv.models.resident.values()
            }

        for name in names:  # the baseline: a server of that model alone
            with serving({name: loaders(paths, work / "kv")[name]}) as (client, _):
                ttft_s(client, name, args.prompt_tokens)  # its load
                times = [ttft_s(client, name, args.prompt_tokens) for _ in range(args.reps)]
                results.setdefault("one model, loaded", {})[name] = statistics.median(times)

        scenarios = {
            "both fit, alternating": {},
            "budget of one, alternating (a swap each)": {
                "max_memory_bytes": int(max(footprints.values()) * 1.5)
            },
        }
        for label, options in scenarios.items():
            with serving(loaders(paths, work / "kv"), **options) as (client, app):
                for name in names:
                    ttft_s(client, name, args.prompt_tokens)  # loads (and, budget: swaps)
                times: dict[str, list[float]] = {name: [] for name in names}
                for _ in range(args.reps):
                    for name in names:
                        times[name].append(ttft_s(client, name, args.prompt_tokens))
                results[label] = {name: statistics.median(t) for name, t in times.items()}
                loads = {m.name: m.num_loads for m in app.state.mlxkv.models.resident.values()}
                print(f"{label}: loads per model {loads}")

    print(f"\nTTFT (s), median of {args.reps}; prompt ~{args.prompt_tokens} tokens, new each time")
    print(f"footprints (weights + {CACHE_BYTES >> 20} MiB cache budget): "
          + ", ".join(f"{n} {b / 2**20:.0f} MiB" for n, b in footprints.items()))  # fmt: skip
    print("\n| scenario | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, row in results.items():
        print(f"| {label} | " + " | ".join(f"{row[name]:.3f}" for name in names) + " |")


if __name__ == "__main__":
    main()
