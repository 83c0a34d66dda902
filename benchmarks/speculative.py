"""Speculative decoding on the default model: generated tokens per second with and without it.

Three greedy tasks: (1) an edit (a ~300-token function rewritten with one variable renamed,
output whole), (2) quoting back part of the prompt, (3) free chat. Configurations, side by
side in each round: mlxkv with speculation off, with the default ("auto": n-gram drafts only
while they pay) and with "ngram" (always); mlx-lm's `stream_generate` as the plain reference.
mlx-lm's own speculation needs a draft model with the same tokenizer and fewer parameters;
the default model (SmolLM2-135M) is the smallest of its family, so there is none to use here.
Targets: default >= 1.8x off on (1) and (2), >= 0.97x on (3); identical text everywhere.

Prints a Markdown table and writes JSON.

    python -m benchmarks.speculative [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache

from mlxkv import Runner

FUNCTION = '''def summarize_orders(orders, tax_rate, discount_threshold):
    """Totals a list of orders: subtotal, discount, tax and the grand total."""
    subtotal = 0.0
    item_count = 0
    for order in orders:
        for item in order["items"]:
            price = item["price"] * item["quantity"]
            subtotal += price
            item_count += item["quantity"]
    discount = 0.0
    if subtotal > discount_threshold:
        discount = subtotal * 0.05
    taxable = subtotal - discount
    tax = taxable * tax_rate
    total = taxable + tax
    largest = None
    for order in orders:
        order_total = sum(i["price"] * i["quantity"] for i in order["items"])
        if largest is None or order_total > largest[1]:
            largest = (order["id"], order_total)
    return {
        "subtotal": round(subtotal, 2),
        "discount": round(discount, 2),
        "tax": round(tax, 2),
        "total": round(total, 2),
        "items": item_count,
        "largest_order": largest,
    }
'''

PASSAGE = (
    "The river Seine rises on the Langres plateau and flows north-west for 777 kilometres "
    "through Paris to the English Channel at Le Havre. Its basin holds a quarter of France's "
    "people. In Paris it is crossed by thirty-seven bridges, and its banks between the Pont de "
    "Sully and the Pont d'Iena are a World Heritage Site. Barges still carry sand, gravel and "
    "grain along it, and boats for visitors run from early morning until late at night."
)

TASKS = {
    "edit": (
        "Rewrite this function with the variable `subtotal` renamed to `gross`. Output the "
        f"whole function and nothing else.\n\n```python\n{FUNCTION}```",
        400,
    ),
    "quote": (
        f"Here is a paragraph:\n\n{PASSAGE}\n\nQuote the paragraph back exactly, word for word.",
        160,
    ),
    "free chat": ("Tell me about the history of Paris and what to see there.", 160),
}
MODES = {"off": None, "default (auto)": "auto", "ngram": "ngram"}


def _mlx_lm(runner: Runner, prompt: list[int], max_tokens: int) -> tuple[str, float]:
    loaded = runner.loaded
    cache = make_prompt_cache(loaded.model)
    text, tps = [], 0.0
    for response in stream_generate(
        loaded.model, loaded.tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache
    ):
        text.append(response.text)
        tps = response.generation_tps
    return "".join(text), tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative.json"))
    args = parser.parse_args()
    runner = Runner.load(None, max_context=4096)
    rows = {}
    for task, (message, max_tokens) in TASKS.items():
        prompt = runner.encode([{"role": "user", "content": message}])
        rates: dict[str, list[float]] = {name: [] for name in [*MODES, "mlx-lm"]}
        texts, drafted = {}, {}
        for _ in range(args.reps):
            for name, mode in MODES.items():
                out = runner.generate(prompt, max_tokens=max_tokens, speculative=mode)
                rates[name].append(out.generation_tps)
                texts[name] = out.text
                drafted[name] = (out.drafted_tokens, out.accepted_tokens, out.generation_tokens)
            text, tps = _mlx_lm(runner, prompt, max_tokens)
            rates["mlx-lm"].append(tps)
            texts["mlx-lm"] = text
        medians = {name: statistics.median(values) for name, values in rates.items()}
        rows[task] = {
            "prompt_tokens": len(prompt),
            "tokens_per_s": medians,
            "all_tokens_per_s": rates,
            "vs_off": {name: medians[name] / medians["off"] for name in medians},
            "drafted_accepted_generated": drafted,
            "identical_text": len(set(texts.values())) == 1,
        }
        print(f"{task}: {json.dumps(rows[task]['vs_off'])}", flush=True)
    _print_table(rows, args.reps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


def _print_table(rows: dict, reps: int) -> None:
    names = [*MODES, "mlx-lm"]
    print(f"\n## Generated tokens per second, greedy, median of {reps} rounds\n")
    print("| task | " + " | ".join(names) + " | default / off | ngram / off | accepted | same |")
    print("|---|" + "---|" * (len(names) + 4))
    for task, row in rows.items():
        rates = " | ".join(f"{row['tokens_per_s'][n]:.1f}" for n in names)
        drafted, accepted, generated = row["drafted_accepted_generated"]["default (auto)"]
        print(
            f"| {task} | {rates} | {row['vs_off']['default (auto)']:.2f} | "
            f"{row['vs_off']['ngram']:.2f} | {accepted}/{drafted} drafted, {generated} "
            f"generated | {row['identical_text']} |"
        )


if __name__ == "__main__":
    main()
