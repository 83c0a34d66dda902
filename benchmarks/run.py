"""Benchmarks: mlxkv vs mlx-lm on the same models, side by side in one run.

    python -m benchmarks.run [--quick] [--out benchmarks/results]

Prints Markdown tables with PASS/FAIL per target (it does not assert), writes JSON, and PNG
plots when matplotlib is installed. Every figure is the median of at least 3 repetitions with
[min-max], except where the table says otherwise. `--quick` (under 5 minutes on 2 cores):
SmolLM2 only, 128/512-token prefill, 64 decode tokens, and one chat conversation in which only
the fresh-cache baseline (a) and the floor (d) are repeated at the last turn.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import blas, cache_ops, chat, kv_quant, throughput
from benchmarks.common import Stat, load_models
from mlxkv import format_bytes
from mlxkv.platform import blas as _blas


@dataclass(frozen=True)
class Plan:
    models: list[str]
    prefill_sizes: list[int]
    decode_tokens: int
    reps: int
    turns: int
    reply_tokens: int
    conversations: int
    fresh_turns: set[int]
    final_samples: int
    op_sizes: list[int]
    quant_tokens: int


FULL = Plan(
    models=["smollm2", "factory-100m"],
    prefill_sizes=[128, 512, 2048],
    decode_tokens=128,
    reps=3,
    turns=10,
    reply_tokens=32,
    conversations=3,
    fresh_turns=set(range(1, 11)),
    final_samples=1,
    op_sizes=[1024, 8192, 32768],
    quant_tokens=256,
)
QUICK = Plan(
    models=["smollm2"],
    prefill_sizes=[128, 512],
    decode_tokens=64,
    reps=3,
    turns=10,
    reply_tokens=16,
    conversations=1,
    fresh_turns={1, 10},
    final_samples=3,
    op_sizes=[1024, 8192, 32768],
    quant_tokens=256,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--models", nargs="*", help="override: smollm2, factory-100m")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict = {"machine": _machine(), "quick": args.quick, "models": {}}
    print(f"# mlxkv benchmarks ({'quick' if args.quick else 'full'})\n\n{report['machine']}\n")
    names = args.models or plan.models
    for name, loaded in load_models(names, args.out).items():
        print(f"## {name}\n", flush=True)
        results = {
            "throughput": throughput.measure(
                loaded, plan.prefill_sizes, plan.decode_tokens, plan.reps
            ),
            "chat": chat.measure(
                loaded,
                plan.turns,
                plan.reply_tokens,
                plan.conversations,
                plan.fresh_turns,
                plan.final_samples,
            ),
            "kv_quant": kv_quant.measure(loaded, plan.quant_tokens),
        }
        results["targets"] = _targets(results)
        report["models"][name] = results
        _print_model(results)
    report["cache_ops"] = cache_ops.measure(plan.op_sizes, plan.reps * 5)
    _print_ops(report["cache_ops"])
    report["blas"] = blas.measure()
    _print_blas(report["blas"])
    report["seconds"] = time.perf_counter() - started
    print(f"\ntotal {report['seconds']:.0f} s")
    path = args.out / f"{'quick' if args.quick else 'full'}-{'-'.join(names)}.json"
    path.write_text(json.dumps(report, indent=2, default=_jsonable))
    print(f"wrote {path}")
    _plot(report, args.out)
    return 0


def _machine() -> str:
    import os

    import mlx.core as mx

    return (
        f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
        f"MLX {mx.__version__} on {mx.default_device()}, BLAS: {_blas.blas_in_use}"
    )


def _targets(results: dict) -> list[dict]:
    tp = results["throughput"]
    turns = results["chat"]["turns"]
    last = turns[-1]
    a, b = last.get("a_fresh_s"), last["b_lru_s"]
    c, d = last["c_mlxkv_s"], last["d_floor_s"]
    targets = [
        ("decode throughput mlxkv/mlx-lm >= 1.0", tp["decode"]["ratio"], 1.0, ">="),
    ]
    for n, row in tp["prefill"].items():
        targets.append((f"prefill {n} tokens mlxkv/mlx-lm >= 1.0", row["ratio"], 1.0, ">="))
    if a is not None:
        targets.append(("turn-10 TTFT (a) fresh / mlxkv >= 5x", a.median / c.median, 5.0, ">="))
    targets.append(("turn-10 TTFT mlxkv / floor (d) <= 1.2x", c.median / d.median, 1.2, "<="))
    targets.append(("turn-10 TTFT mlxkv / mlx-lm LRU (b) <= 1.0", c.median / b.median, 1.0, "<="))
    slack = max(t["kv_allocated_bytes"] - t["kv_used_bytes"] - t["kv_step_bytes"] for t in turns)
    targets.append(("allocated - in use - one step <= 0 bytes (every turn)", slack, 0, "<="))
    out = []
    for name, value, bound, op in targets:
        ok = value >= bound if op == ">=" else value <= bound
        out.append({"target": name, "value": value, "pass": ok})
    return out


def _print_model(results: dict) -> None:
    tp = results["throughput"]
    print("| throughput (tokens/s) | mlxkv | mlx-lm | ratio |\n|---|---|---|---|")
    for n, row in tp["prefill"].items():
        print(f"| prefill {n} | {row['mlxkv_tps']} | {row['mlx_lm_tps']} | {row['ratio']:.2f} |")
    dec = tp["decode"]
    print(
        f"| decode {dec['tokens']} | {dec['mlxkv_tps']} | {dec['mlx_lm_tps']} | "
        f"{dec['ratio']:.2f} |\n"
    )
    print(
        "| turn | prompt | cached | (a) fresh s | (b) LRU s | (c) mlxkv s | (d) floor s | "
        "KV in use | allocated | formula | peak RSS |\n|" + "---|" * 11
    )
    for t in results["chat"]["turns"]:
        fresh = t.get("a_fresh_s", "-")
        print(
            f"| {t['turn']} | {t['prompt_tokens']} | {t['cached_tokens']} | {fresh} | "
            f"{t['b_lru_s']} | {t['c_mlxkv_s']} | {t['d_floor_s']} | "
            f"{format_bytes(t['kv_used_bytes'])} | {format_bytes(t['kv_allocated_bytes'])} | "
            f"{format_bytes(t['kv_formula_bytes'])} | {format_bytes(t['peak_rss_bytes'])} |"
        )
    print("\n| KV cache | bytes in use | vs float | greedy agreement | first divergence |")
    print("|---|---|---|---|---|")
    for name, row in results["kv_quant"].items():
        print(
            f"| {name} | {format_bytes(row['kv_used_bytes'])} | "
            f"{row.get('bytes_vs_float', 1.0):.3f} | {row.get('agreement', 1.0):.1%} | "
            f"{row.get('first_divergence', '-')} of {row['tokens']} |"
        )
    print("\n| target | value | result |\n|---|---|---|")
    for t in results["targets"]:
        print(f"| {t['target']} | {t['value']:.3g} | {'PASS' if t['pass'] else 'FAIL'} |")
    print(flush=True)


def _print_ops(rows: dict) -> None:
    print("## cache operations (microseconds)\n")
    print("| tokens held | KV bytes | trim 1 token | prefix match | memory log call |")
    print("|---|---|---|---|---|")
    for size, row in rows.items():
        print(
            f"| {size} | {format_bytes(row['kv_bytes'])} | {row['trim_us']} | "
            f"{row['prefix_match_us']} | {row['log_call_us']} |"
        )


def _print_blas(row: dict) -> None:
    if not row:
        return
    print("\n## BLAS on Linux (SmolLM2, 128-token prefill, 16-token decode, tokens/s)\n")
    print("| BLAS | prefill | decode |\n|---|---|---|")
    for name in ("reference", "openblas"):
        r = row[name]
        print(f"| {r['blas']} | {r['prefill_tps']:.1f} | {r['decode_tps']:.1f} |")
    print(
        f"| speedup | {row['prefill_speedup']:.1f}x | {row['decode_speedup']:.1f}x |",
        flush=True,
    )


def _jsonable(value):
    if isinstance(value, Stat):
        return value.to_dict()
    if isinstance(value, set):
        return sorted(value)
    raise TypeError(type(value))


def _plot(report: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install -e '.[bench]')")
        return
    for name, results in report["models"].items():
        turns = results["chat"]["turns"]
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, label in (
            ("a_fresh_s", "(a) mlx-lm, fresh cache"),
            ("b_lru_s", "(b) mlx-lm, LRUPromptCache"),
            ("c_mlxkv_s", "(c) mlxkv"),
            ("d_floor_s", "(d) floor: new tokens only"),
        ):
            points = [(t["turn"], t[key].median) for t in turns if key in t]
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
        ax.set(xlabel="turn", ylabel="time to first token (s)", title=f"growing chat, {name}")
        ax.legend()
        fig.tight_layout()
        path = out / f"chat_ttft_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
