"""Streaming for an app: print text deltas as they arrive, cancel after N characters, then
continue the conversation and show that the cache kept everything that was fed.

Run: python examples/stream.py [MODEL]
"""

import sys

from mlxkv import Runner

MAX_CHARS = 40


def main() -> None:
    runner = Runner.load(sys.argv[1] if len(sys.argv) > 1 else None)
    messages = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    shown = ""
    for chunk in runner.stream(messages, max_tokens=200):
        print(chunk.text, end="", flush=True)
        shown += chunk.text
        if len(shown) >= MAX_CHARS:
            break  # the app cancels: leaving the loop is enough
    print(f"\n[cancelled after {len(shown)} characters]")
    held = runner.cache_info().num_tokens
    print(f"[cache holds {held} tokens: the prompt and the reply so far]")

    messages += [
        {"role": "assistant", "content": shown},
        {"role": "user", "content": "Give the story a title."},
    ]
    for chunk in runner.stream(messages, max_tokens=30):
        print(chunk.text, end="", flush=True)
        if chunk.completion:
            out = chunk.completion
            print(f"\n[next turn: {out.prompt_tokens} prompt tokens, {out.cached_tokens} cached]")


if __name__ == "__main__":
    main()
