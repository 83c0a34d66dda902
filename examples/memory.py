"""The cache memory log across turns, side by side: float K/V, kv_bits=8, and a small
max_context. The INFO lines "kv cache: ..." are the runner's own log after each generation.

Run: python examples/memory.py [MODEL]
"""

import logging
import sys

from mlxkv import ContextLengthError, Runner, format_bytes
from mlxkv.models.loading import load_model

SETTINGS = {"float": {}, "kv_bits=8": {"kv_bits": 8}, "max_context=160": {"max_context": 160}}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="  [%(name)s] %(message)s")
    logging.getLogger("mlxkv.runner.prompt_cache.pool").setLevel(logging.WARNING)  # hits, misses
    loaded = load_model(sys.argv[1] if len(sys.argv) > 1 else None)  # shared by all runners
    for name, settings in SETTINGS.items():
        print(f"== {name}")
        runner = Runner(loaded, **settings)
        messages = []
        for turn in range(1, 6):
            messages.append({"role": "user", "content": f"Write sentence number {turn}."})
            try:
                out = runner.generate(messages, max_tokens=24)
            except ContextLengthError as error:
                print(f"  turn {turn}: refused: {error}")
                break
            messages.append({"role": "assistant", "content": out.text})
            info = runner.cache_info()
            print(
                f"  turn {turn}: {info.num_tokens} tokens, {format_bytes(info.used_bytes)} in "
                f"use, {format_bytes(info.allocated_bytes)} allocated ({out.finish_reason})"
            )


if __name__ == "__main__":
    main()
