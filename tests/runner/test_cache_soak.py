"""A random mix of what clients do to the prompt cache (new turns of three conversations,
regenerations, edited turns, cancels mid-prefill and mid-decode, streams left early, two
conversations at once), under several entries and a byte budget that evicts and fits: after
every request, every idle entry's K/V equal a fresh forward of its recorded tokens, and every
streamed token's log-probability equals the model's with no cache at all.

The suite's own invariant (`tests/invariants.py`) checks the entry a request ended with; this
checks all of them, the ones copied, fitted or left behind by other requests included.
"""

from __future__ import annotations

import random
import threading

import mlx.core as mx
import pytest

from mlxkv import Runner
from mlxkv.cache.building import make_cache
from tests.factories import joined
from tests.tolerances import assert_logits_close, logits_tolerance

STEPS = 24
WORDS = ["cache", "token", "window", "reply", "budget", "memory", "entry", "prefix", "ocean"]
OPS = ["turn", "turn", "regenerate", "edit", "cancel_prefill", "cancel_decode", "leave", "both"]
# (model, kv_bits, cache_bytes): budgets that keep one to three conversations (of up to 600
# tokens), so entries are evicted, fitted, and left behind idle as others are copied
KINDS = [
    ("llama", None, 600_000),
    ("gemma3_text", None, 150_000),
    ("lfm2", None, 400_000),
    ("mamba", None, 150_000),
    ("quantizable", 8, 200_000),
]
SYSTEM = "You are brief. Answer in one line, and say which tokens you saw."


class _Soak:
    """A Runner, three conversations, and the no-cache references."""

    def __init__(self, loaded, kv_bits, cache_bytes, seed):
        self.model, self.kv_bits = loaded.model, kv_bits
        self.runner = Runner(
            loaded, max_context=1024, prefill_step_size=16, kv_bits=kv_bits,
            cache_entries=3, cache_bytes=cache_bytes,
        )  # fmt: skip
        self.rng = random.Random(seed)
        # one system prompt, as an agent's sessions share theirs: a new chat copies it
        self.chats = [[{"role": "system", "content": SYSTEM}] for _ in "abc"]

    def _words(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(3, 20)))

    def next_messages(self, chat: int, op: str) -> list[dict]:
        """The chat's messages for this request (edited in place as `op` says)."""
        messages = self.chats[chat]
        if len(self.runner.encode(messages)) > 600:  # within the window: no cut, no shift
            del messages[1:]
        if op == "edit" and len(messages) >= 3:
            del messages[-2:]
        if op != "regenerate" or messages[-1]["role"] != "user":
            if messages[-1]["role"] == "user":
                messages.append({"role": "assistant", "content": "ok"})
            messages.append({"role": "user", "content": self._words()})
        return messages

    def request(self, messages: list[dict], op: str, max_tokens: int) -> None:
        """One request, the caller leaving or cancelling where `op` says; its streamed
        log-probabilities checked against the no-cache model."""
        prompt = self.runner.encode(messages)
        cancel = threading.Event()

        def progress(done: int, total: int) -> None:
            if op == "cancel_prefill" and done >= 16:
                cancel.set()

        stream = self.runner.stream(
            messages, max_tokens=max_tokens, logprobs=1, cancel=cancel, progress=progress
        )
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if op == "cancel_decode" and len(chunks) == 3:
                cancel.set()
            if op == "leave" and len(chunks) == 2:
                stream.close()
                break
        tokens = [c for c in chunks if c.token is not None]
        self._check_logprobs(prompt, tokens)
        text = "".join(c.text for c in chunks)
        if messages[-1]["role"] == "user":
            messages.append({"role": "assistant", "content": text or "ok"})

    def _check_logprobs(self, prompt: list[int], chunks: list) -> None:
        if not chunks:
            return
        logits = self._reference(prompt + [c.token for c in chunks])[len(prompt) - 1 : -1]
        want = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        got = mx.array([c.logprob.logprob for c in chunks])
        picked = want[mx.arange(len(chunks)), mx.array([c.token for c in chunks])]
        bound = 2 * logits_tolerance(logits, self.kv_bits)
        assert mx.abs(got - picked).max().item() <= bound, "log-probabilities differ"

    def _reference(self, tokens: list[int]) -> mx.array:
        """Logits at every position: the model with no cache (with quantized K/V, a fresh
        cache fed every token at once: quantizing is per head-dimension group, so exact)."""
        ids = mx.array(tokens)[None]
        if self.kv_bits is None:
            return self.model(ids)[0]
        cache = make_cache(self.model, kv_bits=self.kv_bits)
        return cache.forward(self.model, tokens).reshape(len(tokens), -1)

    def check_entries(self) -> None:
        """Every idle entry's record is its cache's, and its K/V a fresh forward's (on the
        Runner's engine thread, where its arrays were made)."""
        self.runner._engine.call(self._check_entries)

    def _check_entries(self) -> None:
        for entry in self.runner._pool.entries:
            held = entry.cache.tokens
            assert entry.tokens.tolist() == held, "an entry's record is not its cache's"
            if not held:
                continue
            copy = entry.cache.copy()
            copy.capacity_tokens = None
            got = copy.forward(self.model, held[-1:]).reshape(-1)
            want = self._reference(held + held[-1:])[-1]
            assert_logits_close(got, want, f"an entry of {len(held)} tokens", self.kv_bits)


@pytest.mark.parametrize(("model", "kv_bits", "cache_bytes"), KINDS, ids=[m for m, _, _ in KINDS])
def test_every_entry_holds_what_it_records_through_a_random_mix_of_requests(
    loaded_tiny, loaded_quantizable, model, kv_bits, cache_bytes
):
    loaded = loaded_quantizable if model == "quantizable" else loaded_tiny(model)
    soak = _Soak(loaded, kv_bits, cache_bytes, seed=len(model))
    for step in range(STEPS):
        op = soak.rng.choice(OPS)
        chats = [0, 1] if op == "both" else [soak.rng.randrange(3)]
        asked = [(soak.next_messages(c, op), soak.rng.randint(1, 16)) for c in chats]
        if op == "both":  # two conversations at once (decoded in one batch)
            failures = []
            threads = [threading.Thread(target=_run, args=(soak, m, n, failures)) for m, n in asked]
            for thread in threads:
                thread.start()
            joined(*threads, timeout_s=120)
            assert not failures, f"step {step}: {failures[0]!r}"
        else:
            soak.request(*asked[0][:1], op, asked[0][1])
        soak.check_entries()
        assert soak.runner.cache_info().held_bytes <= cache_bytes, f"step {step}: over budget"


def _run(soak: _Soak, messages: list[dict], max_tokens: int, failures: list) -> None:
    try:
        soak.request(messages, "turn", max_tokens)
    except BaseException as error:  # reported by the test's thread
        failures.append(error)
