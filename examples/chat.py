"""A multi-turn conversation through the Python API, printing per turn how many prompt tokens
came from the cache and the time to first token.

Run: python examples/chat.py [MODEL]   (default: the bundled SmolLM2; see README)
"""

import sys

from mlxkv import Runner

QUESTIONS = [
    "What is the capital of France?",
    "What river flows through it?",
    "Name a famous museum there.",
    "And the capital of Italy?",
]


def main() -> None:
    runner = Runner.load(sys.argv[1] if len(sys.argv) > 1 else None)
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    for turn, question in enumerate(QUESTIONS, start=1):
        messages.append({"role": "user", "content": question})
        out = runner.generate(messages, max_tokens=48)
        messages.append({"role": "assistant", "content": out.text})
        print(f"turn {turn}: {question}\n  -> {out.text.strip()}")
        print(
            f"  prompt {out.prompt_tokens} tokens, cached {out.cached_tokens}, "
            f"ttft {out.ttft * 1000:.0f} ms, {out.generation_tps:.1f} tok/s"
        )
    print(runner.cache_info().log_line())


if __name__ == "__main__":
    main()
