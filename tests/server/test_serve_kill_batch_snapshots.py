"""A hybrid model's replies decoded together in a batch cross a disk-tier block boundary, the
server is killed with SIGKILL once their turns are written, and a restarted server is sent
prompts that leave each reply after the boundary: the restore reaches the boundary (the
snapshot each row took there in a batched step; without it, the prompt's end) and the answers
equal a server without a disk tier's, by log-probabilities. Token-id prompts through
`/v1/completions`, so the divergence falls exactly where the test puts it."""

from __future__ import annotations

import threading

import numpy as np

from mlxkv import Runner
from tests.factories import tiny_model_dir
from tests.server.test_serve_kill import _assert_clean, _Server, _wait_for_writes

_BLOCK_TOKENS = 256
_PROMPT_TOKENS = 240  # the replies cross the boundary 16 tokens in
_REPLY_TOKENS = 40
_KEPT_REPLY_TOKENS = 30  # of each reply, in the prompt after the restart: past the boundary
_ROWS = 3
_LOGPROB_ATOL = 1e-3


def _complete(server: _Server, prompt: list[int], max_tokens: int):
    return server.client.completions.create(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1
    )


def test_batched_replies_restore_to_their_boundary_snapshot_after_kill_9(
    model_root, loaded_tiny, tmp_path
):
    model = str(tiny_model_dir("lfm2", model_root))
    rng = np.random.default_rng(40)
    prompts = [rng.integers(10, 200, _PROMPT_TOKENS).tolist() for _ in range(_ROWS)]
    # each reply's ids, greedy, from a Runner without a disk tier (rows decode as alone)
    alone = Runner(loaded_tiny("lfm2"), speculative=None)
    replies = [alone.generate(p, max_tokens=_REPLY_TOKENS, temperature=0.0).tokens for p in prompts]
    assert all(len(r) == _REPLY_TOKENS for r in replies)
    cache_dir = tmp_path / "kv"
    server = _Server(model, cache_dir)
    start = threading.Barrier(_ROWS)

    def ask(i: int) -> None:
        start.wait()
        _complete(server, prompts[i], _REPLY_TOKENS)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(_ROWS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert _wait_for_writes(server)
    server.process.kill()
    _assert_clean(server.process.communicate()[1])
    server, reference = _Server(model, cache_dir), _Server(model, None)
    try:
        for prompt, reply in zip(prompts, replies, strict=True):
            diverged = prompt + reply[:_KEPT_REPLY_TOKENS] + [7, 8, 9]
            got = _complete(server, diverged, 6)
            want = _complete(reference, diverged, 6)
            assert got.choices[0].text == want.choices[0].text
            worst = max(
                abs(a - b)
                for a, b in zip(
                    got.choices[0].logprobs.token_logprobs,
                    want.choices[0].logprobs.token_logprobs,
                    strict=True,
                )
            )
            assert worst <= _LOGPROB_ATOL
            assert got.usage.prompt_tokens_details.cached_tokens >= _BLOCK_TOKENS
    finally:
        stderr = server.stop(kill=False)
        reference.stop(kill=True)
    _assert_clean(stderr)
