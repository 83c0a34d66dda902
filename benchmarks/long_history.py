"""Long chat histories in a small window: the time of a fully cached request, by history length.

Fitting a chat to the window renders the chat template; it used to render once per possible cut
(quadratic in the number of messages: 0.18 s at 50 turns, 1.76 s at 200, 7.3 s at 400 at
max_context=512). Now each request renders the whole chat a fixed number of times plus O(log n)
renders of about the window's size. Prints a Markdown table and writes JSON.

    python -m benchmarks.long_history [--turns 50 200 1000] [--max-context 512] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import filler_text, repeat, timed
from mlxkv import Runner


def _chat(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a helpful assistant. Be brief."}]
    for turn in range(turns):
        messages += [
            {"role": "user", "content": f"Question {turn}: {filler_text(12, seed=turn)}?"},
            {"role": "assistant", "content": f"Answer {turn}: {filler_text(12, seed=-turn)}."},
        ]
    messages.append({"role": "user", "content": "And what follows from all that?"})
    return messages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[50, 200, 1000])
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    runner = Runner.load(args.model, max_context=args.max_context)
    rows = []
    print("| turns | messages | prompt tokens | cached | fully cached request, s |")
    print("|---|---|---|---|---|")
    for turns in args.turns:
        messages = _chat(turns)
        runner.generate(messages, max_tokens=1)  # puts the fitted chat in the cache
        stat = repeat(lambda m=messages: timed(lambda: runner.generate(m, max_tokens=1)), 3)
        out = runner.generate(messages, max_tokens=1)
        rows.append(
            {
                "turns": turns,
                "messages": len(messages),
                "prompt_tokens": out.prompt_tokens,
                "cached_tokens": out.cached_tokens,
                "seconds": stat.to_dict(),
            }
        )
        print(
            f"| {turns} | {len(messages)} | {out.prompt_tokens} | {out.cached_tokens} | {stat} |",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "long_history.json"
    path.write_text(json.dumps({"max_context": args.max_context, "rows": rows}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
