"""The measuring parts of `benchmarks.gpu_check`, each run in a process of its own.

    python -m benchmarks.gpu_check_parts PART PLAN_JSON RESULT_JSON

PART is `models` (the ~1B factory llama as bf16 and 4-bit, and the 64k-window agent model),
`throughput` (benchmarks/throughput.py on both dtypes), `batching` (1, 4 and 8 streams over
HTTP, as benchmarks/batching.py measures them) or `agent` (the recorded agent sessions, as
benchmarks/agent_replay.py replays them). A part rewrites RESULT_JSON after every measurement,
so what it measured before its time ran out is kept. The models are built once per work folder
(`manifest.json`) and reused by a rerun while the machine is up.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

# Shapes of the factory llama (its 512-token vocabulary kept): "1b" is Llama-3.2-1B's body
# (16 layers of 2048, GQA 32/8), about 0.97B parameters; "small" runs in seconds on a CPU.
SHAPES = {
    "1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "intermediate_size": 1024,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
}
WINDOW_TOKENS = 65536  # the throughput model's window holds the 32k prompt


class Result:
    """A part's findings, rewritten to its file after every change (write, then rename)."""

    def __init__(self, path: Path):
        self.path, self.data = path, {}

    def set(self, key: str, value: object) -> None:
        self.data[key] = value
        scratch = self.path.with_suffix(".tmp")
        scratch.write_text(json.dumps(self.data, indent=1, default=_plain))
        scratch.replace(self.path)


def _plain(value: object) -> object:
    return value.to_dict() if hasattr(value, "to_dict") else str(value)


def _manifest(work: Path) -> dict:
    path = work / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


# -- models ---------------------------------------------------------------------------------


def models(plan: dict, work: Path, result: Result) -> None:
    """The factory llama in float32, converted by mlx-lm to bf16 and 4-bit (group 64), and the
    agent replay's 64k-window llama; skipped where the manifest says they are built."""
    from mlx_lm import convert

    from benchmarks.agent_replay import long_window_model
    from mlxkv.testing.factory import build_model

    manifest = _manifest(work)
    shape = plan["model"]
    f32 = work / f"llama-{shape}-f32"
    for dtype, quantize in (("bf16", False), ("q4", True)):
        done = work / f"llama-{shape}-{dtype}"
        if manifest.get(dtype) == str(done) and (done / "config.json").exists():
            continue
        if not (f32 / "config.json").exists():
            overrides = {**SHAPES[shape], "max_position_embeddings": 2 * WINDOW_TOKENS}
            build_model("llama", f32, config_overrides=overrides)
        scratch = done.with_name(done.name + ".tmp")
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(done, ignore_errors=True)
        options = {"quantize": True, "q_bits": 4, "q_group_size": 64} if quantize else {}
        convert(str(f32), str(scratch), dtype="bfloat16", **options)
        scratch.rename(done)
        manifest[dtype] = str(done)
        _save_manifest(work, manifest)  # a part cut off later keeps what is built
        result.set(dtype, str(done))
    if not manifest.get("agent") or not Path(manifest["agent"], "config.json").exists():
        manifest["agent"] = str(long_window_model(work / "agent", plan["agent_model"]))
        _save_manifest(work, manifest)
    shutil.rmtree(f32, ignore_errors=True)
    result.set("manifest", manifest)


def _save_manifest(work: Path, manifest: dict) -> None:
    scratch = work / "manifest.json.tmp"
    scratch.write_text(json.dumps(manifest, indent=1))
    scratch.replace(work / "manifest.json")


# -- throughput -----------------------------------------------------------------------------


def throughput(plan: dict, work: Path, result: Result) -> None:
    """benchmarks/throughput.py's `measure` on the bf16 model, then the 4-bit one (it runs
    each shape once on each side untimed: on a GPU a first run compiles kernels)."""
    import mlx.core as mx

    from benchmarks import common
    from benchmarks import throughput as bench

    manifest = _manifest(work)
    for dtype in plan["dtypes"]:
        loaded = common.load_model(manifest[dtype])
        found = bench.measure(loaded, plan["prefill_sizes"], plan["decode_tokens"], plan["reps"])
        result.set(dtype, found)
        print(f"throughput {dtype}: {json.dumps(found, default=_plain)}", flush=True)
        del loaded, found
        gc.collect()
        mx.clear_cache()


# -- servers --------------------------------------------------------------------------------


def _server_env(plan: dict, work: Path) -> dict[str, str]:
    """On the CPU, mlx_lm.server gets the OpenBLAS mlxkv uses (LD_PRELOAD), as every
    benchmark's peer does; on a GPU the BLAS plays no part. Both servers stay off the network
    (the device machine has none) and get a hub cache folder that exists (mlx_lm.server's
    /v1/models scans it and fails without one)."""
    from benchmarks.serve_agent import blas_env

    env = blas_env() if plan["device"] == "cpu" else dict(os.environ)
    hub = work / "hf-hub"
    hub.mkdir(parents=True, exist_ok=True)
    return {**env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub)}


def _server_commands(model: str, window_tokens: int) -> dict[str, list[str]]:
    return {
        "mlxkv serve": [sys.executable, "-m", "mlxkv.cli", "serve", "-m", model,
                        "--host", "127.0.0.1", "--max-context", str(window_tokens),
                        "--no-cache-dir", "--port"],
        "mlx_lm.server": [sys.executable, "-m", "mlx_lm", "server", "--model", model,
                          "--host", "127.0.0.1", "--log-level", "WARNING", "--port"],
    }  # fmt: skip


def _start_servers(plan: dict, model: str, window_tokens: int, work: Path) -> tuple[list, dict]:
    """Both servers on ephemeral loopback ports; (processes, {name: base url})."""
    from benchmarks.serve_agent import free_port, start_server

    env = _server_env(plan, work)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    processes, urls = [], {}
    for name, command in _server_commands(model, window_tokens).items():
        port = free_port()
        log = logs / f"{name.split()[0]}-{port}.log"
        processes.append(start_server([*command, str(port)], port, env, log))
        urls[name] = f"http://127.0.0.1:{port}"
    return processes, urls


def _stop(processes: list) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(30)
        except Exception:  # noqa: BLE001  (still running: killed)
            process.kill()


# -- batching -------------------------------------------------------------------------------


def batching(plan: dict, work: Path, result: Result) -> None:
    """N concurrent streams (benchmarks/batching.py's `throughput`), the servers in turns, a
    round at a time; per load the medians of the rounds and the median of each round's
    ratio."""
    import openai

    from benchmarks import batching as bench

    model = _manifest(work)["bf16"]
    processes, urls = _start_servers(plan, model, bench.WINDOW_TOKENS, work)
    try:
        clients = {
            name: openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
            for name, url in urls.items()
        }
        for client in clients.values():
            bench.throughput(client, 1, 8, -1)  # warm
        rates = {name: {str(n): [] for n in bench.LOADS} for name in clients}
        for round_ in range(plan["rounds"]):
            for offset, (name, client) in enumerate(clients.items()):
                for n in bench.LOADS:
                    prompt = 1000 * round_ + 100 * offset + 10 * n
                    rate = bench.throughput(client, n, plan["stream_tokens"], prompt)
                    rates[name][str(n)].append(rate)
            result.set("rates", rates)
            result.set("summary", _stream_summary(rates))
            print(f"batching round {round_ + 1}: {rates}", flush=True)
    finally:
        _stop(processes)


def _stream_summary(rates: dict) -> dict:
    ours, peer = rates["mlxkv serve"], rates["mlx_lm.server"]
    summary = {}
    for n, samples in ours.items():
        each = [a / b for a, b in zip(samples, peer[n], strict=False) if b]
        summary[n] = {
            "mlxkv_tps": statistics.median(samples),
            "mlx_lm_tps": statistics.median(peer[n]),
            "ratio": statistics.median(each) if each else None,
        }
    return summary


# -- agent replay ---------------------------------------------------------------------------


def agent(plan: dict, work: Path, result: Result) -> None:
    """Each recorded session replayed on both servers (fresh, so the first turn is cold), as
    benchmarks/agent_replay.py's `replay` does: per turn the TTFT and cached/prompt tokens."""
    from benchmarks import agent_replay as bench

    model = _manifest(work)["agent"]
    processes, urls = _start_servers(plan, model, bench.WINDOW_TOKENS, work)
    try:
        for agent_name in plan["agents"]:
            _, api_path = bench.SESSIONS[agent_name]
            bodies = bench.load_session(agent_name)[: plan["agent_turns"]]
            turns = {}
            for name, url in urls.items():
                turns[name] = [
                    bench.send(url, api_path, bench._as_mlxkv(agent_name, body))
                    if name == "mlxkv serve"
                    else bench.send(url, "/v1/chat/completions", bench.as_chat(agent_name, body))
                    for body in bodies
                ]
                print(f"agent {agent_name}, {name}: {turns[name]}", flush=True)
            result.set(agent_name, turns)
    finally:
        _stop(processes)


PARTS = {"models": models, "throughput": throughput, "batching": batching, "agent": agent}


def main(argv: list[str] | None = None) -> int:
    part, plan_path, result_path = argv if argv is not None else sys.argv[1:]
    plan = json.loads(Path(plan_path).read_text())
    import mlxkv  # noqa: F401  (picks the BLAS before mlx is imported)

    PARTS[part](plan, Path(plan["work"]), Result(Path(result_path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
