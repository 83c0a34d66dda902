"""A long chat in a small window: per turn, the prompt and cached tokens and what the context
policy did (messages dropped, shifts in place, reprocessing).

    python -m benchmarks.long_chat [--turns 30] [--max-context 512] [--model PATH]
"""

from __future__ import annotations

import argparse
import logging
import time

from benchmarks.common import filler_text
from mlxkv import Runner

EVENTS = ("dropped", "context shift", "reprocess", "checkpoint")


class _Events(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(word in message for word in EVENTS):
            self.lines.append(message)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    events = _Events()
    logger = logging.getLogger("mlxkv")
    logger.addHandler(events)
    logger.setLevel(logging.INFO)
    runner = Runner.load(args.model, max_context=args.max_context)
    messages = [{"role": "system", "content": "You are a helpful assistant. Be brief."}]
    print("| turn | prompt | cached | generated | ttft ms | held | what happened |")
    print("|---|---|---|---|---|---|---|")
    for turn in range(1, args.turns + 1):
        question = f"Question {turn}: tell me about {filler_text(8, seed=turn)}."
        messages.append({"role": "user", "content": question})
        events.lines.clear()
        out = runner.generate(messages, max_tokens=args.max_tokens)
        messages.append({"role": "assistant", "content": out.text})
        held = runner.cache_info().num_tokens
        happened = "; ".join(events.lines) or "-"
        print(
            f"| {turn} | {out.prompt_tokens} | {out.cached_tokens} | {out.generation_tokens} | "
            f"{out.ttft * 1000:.0f} | {held} | {happened} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    start = time.perf_counter()
    code = main()
    print(f"\n{time.perf_counter() - start:.0f} s")
    raise SystemExit(code)
