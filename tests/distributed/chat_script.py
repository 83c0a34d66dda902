"""Run by the tests under `mlx.launch -n 2 --backend ring` (and alone, as the reference): a
3-turn greedy chat (rank 0 writes each token's log-probability and its 3 likeliest), then a
request that forces a trim, one that forces a miss, and two cancelled generations (a caller
that stops reading, and `Runner.cancel()`), a sampled one with no seed, its prompt again after
its entry was dropped by its cache key, and once more by a request made before its key was
dropped and run after, then a prompt scored (`prompt_logprobs`) after its prefix was cached.
After each request every rank writes down what its entry holds, to
OUT_DIR/rank<r>.json.

    python tests/distributed/chat_script.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlxkv import Runner

QUESTIONS = ["What is the capital of France?", "What river flows through it?", "And Italy?"]
SCORED = "A prompt scored token by token, about rivers"


def main(model_dir: str, out_dir: str) -> None:
    runner = Runner.load(model_dir, max_context=1024)
    records = []

    def record(completion, logprobs: list | None = None) -> None:
        info = runner.cache_info()
        records.append(
            {
                "logprobs": logprobs,
                "layers": len(runner.loaded.model.layers),  # this rank's: pipeline splits them
                "tokens": None if completion is None else completion.tokens,
                "text": None if completion is None else completion.text,
                "cached": None if completion is None else completion.cached_tokens,
                "finish": None if completion is None else completion.finish_reason,
                "held": runner.cache_tokens,
                "allocated_bytes": info.allocated_bytes,
            }
        )

    if runner.rank == 0:
        chat = []
        for question in QUESTIONS:
            chat.append({"role": "user", "content": question})
            chunks = list(runner.stream(chat, max_tokens=12, logprobs=3))
            out = chunks[-1].completion
            record(out, [[c.logprob.logprob, c.logprob.top] for c in chunks if c.logprob])
            chat.append({"role": "assistant", "content": out.text})
        # A trim: the first question again, answered differently: the entry goes back.
        record(runner.generate([{"role": "user", "content": QUESTIONS[0]}], max_tokens=6))
        # A miss: nothing in common with what is held.
        record(runner.generate("Unrelated text about caches and trees.", max_tokens=6))
        stream = runner.stream("Once upon a time there was", max_tokens=200)
        for n, _ in enumerate(stream):
            if n == 3:
                break  # the caller leaves: the others must stop at the same token
        stream.close()
        record(None)
        for n, chunk in enumerate(runner.stream("The quick brown fox", max_tokens=200)):
            if n == 3:
                runner.cancel()
            last = chunk
        record(last.completion)
        # Sampled with no seed: rank 0 draws one for every rank, or their answers part.
        story = runner.generate("Once upon a time", max_tokens=12, temperature=1.0, cache_key="s")
        record(story)
        # Its entry dropped on every rank by its cache key: the same prompt reuses nothing.
        assert runner.drop_cache_entries("s") == 1
        record(runner.generate("Once upon a time", max_tokens=4))
        # Made before its key was dropped, run after: its entry freed at its end on every rank.
        made = runner.stream("Once upon a time", max_tokens=4, cache_key="q")
        assert runner.drop_cache_entries("q") == 0
        record(list(made)[-1].completion)
        # Scored (`prompt_logprobs`): every rank feeds the cached prefix again on a scratch
        # cache; rank 0 writes the prompt tokens' log-probabilities.
        record(runner.generate(SCORED, max_tokens=2))
        chunks = list(runner.stream(SCORED + " and the seas", max_tokens=2, prompt_logprobs=3))
        scored = chunks[-1].prompt_logprobs.logprobs
        record(chunks[-1].completion, [[t.logprob, t.top] for t in scored])
        runner.close()  # ends the other ranks' follow()
    else:
        for completion in runner.follow():
            record(completion)
    Path(out_dir, f"rank{runner.rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main(*sys.argv[1:3])
