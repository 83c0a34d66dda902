"""One prompt's walk from `Runner.stream` to its last chunk enters each mlxkv module at most
twice for the request, and at most twice more per generated token (issue 25): a module entered
more often may be one concern spread over several calls. It is a budget, not a gate (issue 38:
nothing is merged only to meet a count): a module may exceed it with its reason written in
`_OVER_BUDGET`.

What is an entry. A call of a function of module M (a property or a dataclass's `__init__`
included; a generator's first step included, its later resumptions not) from a frame of another
module, on the caller's thread or the engine thread. Not counted:
  - calls from mlx-lm's model code into our cache objects, and everything under them: that is
    mlx-lm's per-layer cache protocol (`update_and_fetch`, `make_mask`, indexing), not our walk;
  - the first step of a generator that a function of its own module made and returned (the
    call that returned it was the entry, as `Relay.__iter__` returning its consumer loop);
  - calls into `config` and `errors`, the helpers every layer may import
    (`tests/test_layering.py`): range checks and units, not a stage of the walk.

What is the walk. A chat prompt with a system message (the server's form), greedy, decoded
plainly (`speculative=None`), on a new Runner's cache in three states: empty (a miss: no entry
to reuse), holding the same conversation (a regenerated reply: the entry trimmed back in place)
and holding its previous turn (the next turn: the entry trimmed back to where its reply began,
then fed the reply as the client renders it and the new message); and the miss decoded with
speculative drafting, the default. How often drafts are verified depends on what the model
accepts, a property of the weights and the text rather than of the code: with these tiny
random models the n-gram drafter finds nothing, so the speculative walk counts the drafter's
bookkeeping around the plain stretches between drafts. Not counted: a stream that joins the
engine's decode batch (`batched=True`, the server's way), whose steps are the batch's, shared
by every row; it enters the batch's modules when it joins and leaves, and `ModelCache` when
its prefill and its row are handed over (`tests/runner/test_batching.py` checks its tokens).

How the counts are separated. Each module's entries are `request + per_token * T + per_layer *
L + per_layer_token * L * T` for T generated tokens on an L-layer model: four walks (L = 1, 2;
T = 2, 4) give the four numbers, and a fifth (L = 2, T = 6) checks that the form holds. The
limits apply to `request` and `per_token`; loops over the model's layers (ModelCache fanning a
call out to its layers) scale with the model's depth, not with how the walk is spread. The
first token comes from prefill's logits: `mlxkv.cache.model_cache`, for one, is built, fed the
prompt, materialized and measured when its entry records it, once per request, and per token
fed and (after the first) checked against the window: 4 + 2T - 1, counted (3, 2).
"""

from __future__ import annotations

import gc
import inspect
import sys
import threading
from collections import Counter

import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.testing.factory import build_model

_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_MAX_ENTRIES = 2
# Modules over the budget, with the most entries (request, per token) and why.
_OVER_BUDGET = {
    "mlxkv.cache.model_cache": (
        (4, 2),
        "the K/V object itself: built, fed, then materialized and measured as its entry "
        "records it (two calls with two jobs, not one merged only for this count); a lookup "
        "that reuses part of an entry asks which of its tokens a context shift left exact",
    ),
    "mlxkv.runner.text.segments": (
        (4, 0),
        "the chat prompt is rendered three times (the prompt; without the generation prompt "
        "and its system messages alone, for the landmarks), each render's text tokenized "
        "here once: one call per render, and one for the system messages' render kept by "
        "its input (rendered only when not kept yet: a new Runner's walk)",
    ),
    "mlxkv.runner.text.controls": (
        (3, 0),
        "the chat prompt is rendered three times (as for `segments`), each render's messages "
        "masked here once (`ControlText.masked`: which content, and which tool calls, hold "
        "control-token text)",
    ),
    "mlxkv.runner.prompt_cache.entry": (
        (3, 0),
        "the entry a request claims, the request's ids converted to the array entries hold "
        "(`token_array`, for the pool's lookup), and the entry recorded when it ends",
    ),
    "mlxkv.runner.text.chat": (
        (4, 0),
        "the chat prompt is rendered three times (as for `segments`: the prompt, and for the "
        "landmarks its render without the generation prompt and the system messages' alone, "
        "made only when not kept yet: a new Runner's walk), and the system render's key asks "
        "which switches the template reads (`template_switches`)",
    ),
    "mlxkv.runner.text.replies": (
        (4, 0),
        "the replies a prompt sends back looked up once (`known_in`), the reply remembered at "
        "its end, and what an assistant message sent back is known by (`reply_keys`: its text, "
        "or its text and tool calls) asked by each render that reads one (the next turn's "
        "prompt, and its render without the generation prompt for the landmarks)",
    ),
    "mlxkv.decoding.speculative": (
        (3, 0),
        "a speculative reply's settings are records of the loop that reads them: the request "
        "path makes its `DraftLength` and its `Speculation`, then the loop runs "
        "(`speculative_tokens`, through `decoders`)",
    ),
    "mlxkv.runner.scheduling.lockstep": (
        (4, 0),
        "unsharded, a `Solo` stands where the ranks' `Lockstep` does (no branch for the "
        "unsharded case): the request is checked, prepared and run through it, and the "
        "memory line asks it for the ranks' part, each a no-op alone",
    ),
}
_PROMPT = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "The capital of France is"},
]
_NOT_COUNTED = ("mlxkv.config", "mlxkv.errors")


def _module_of(frame) -> str:
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class _EntryCounter:
    """A profile function counting entries into mlxkv modules while `active` is set."""

    def __init__(self):
        self.active = False
        self.entries: Counter[str] = Counter()
        self._seen: set = set()  # generator frames already counted or not to count (test-only)
        self._lock = threading.Lock()
        self._local = threading.local()  # per thread: frames of mlx-lm's calls into our caches

    def __call__(self, frame, event, arg):
        if not self.active:
            return
        protocol = self._local.__dict__.setdefault("protocol", set())
        if event == "return":
            protocol.discard(frame)
            made = getattr(arg, "gi_frame", None) if inspect.isgenerator(arg) else None
            if made is not None and _module_of(made) == _module_of(frame):
                with self._lock:
                    self._seen.add(made)
            return
        if event != "call" or protocol:
            return
        module, caller = _module_of(frame), _module_of(frame.f_back)
        if not module.startswith("mlxkv") or caller == module:
            return
        if caller.startswith("mlx_lm"):
            protocol.add(frame)
            return
        with self._lock:
            if frame.f_code.co_flags & _GENERATOR_FLAGS:
                if frame in self._seen:
                    return
                self._seen.add(frame)
            if module not in _NOT_COUNTED:
                self.entries[module] += 1

    def close(self):
        self._seen.clear()


@pytest.fixture(scope="module")
def layered(tmp_path_factory):
    """The factory llama with 1 and with 2 layers, by layer count."""
    root = tmp_path_factory.mktemp("walk")
    return {
        layers: load_model(
            build_model("llama", root / str(layers), config_overrides={"num_hidden_layers": layers})
        )
        for layers in (1, 2)
    }


def _regenerated(runner) -> list[dict]:
    list(runner.stream(_PROMPT, max_tokens=3, temperature=0, speculative=None))
    return _PROMPT


def _next_turn(runner) -> list[dict]:
    """The reply is given, not the one generated: a tiny random model's text need not
    encode back to its tokens, and each model would trim back by a different length."""
    list(runner.stream(_PROMPT, max_tokens=3, temperature=0, speculative=None))
    reply = {"role": "assistant", "content": "Paris."}
    return [*_PROMPT, reply, {"role": "user", "content": "And of Spain?"}]


def _miss(runner) -> list[dict]:
    return _PROMPT


# Each walk: what the Runner serves before the counted request (it returns that request's
# prompt), and the counted request's speculative mode.
_WALKS = {
    "miss": (_miss, None),
    "regenerated": (_regenerated, None),
    "next turn": (_next_turn, None),
    "miss, speculative": (_miss, "auto"),
}


def _walk_entries(loaded, max_tokens: int, walk: str = "miss") -> Counter[str]:
    counter = _EntryCounter()
    threading.setprofile(counter)  # before the Runner: any thread it starts starts with it
    # No collection during the walk: an earlier Runner's finalizer (stopping its engine
    # thread) would count as an entry at whatever moment the collector happens to run.
    gc.collect()
    gc.disable()
    try:
        runner = Runner(loaded)
        # its engine may run on a kept thread an earlier walk's Runner started
        # (`run_on_kept_thread`), which carries that walk's profile: this walk's, there
        runner._engine.call(sys.setprofile, counter)
        try:
            before, speculative = _WALKS[walk]
            prompt = before(runner)
            sys.setprofile(counter)
            counter.active = True
            chunks = list(
                runner.stream(prompt, max_tokens=max_tokens, temperature=0, speculative=speculative)
            )
            counter.active = False
        finally:
            sys.setprofile(None)
            runner._engine.call(sys.setprofile, None)
            runner.close()
    finally:
        gc.enable()
        threading.setprofile(None)
        counter.close()
    assert sum(chunk.token is not None for chunk in chunks) == max_tokens
    return counter.entries


def _separated(layered, walk: str) -> dict[str, tuple[int, int, int, int]]:
    """Per module: (request, per_token, per_layer, per_layer_token) entries."""
    walks = {(layers, tokens): _walk_entries(layered[layers], tokens, walk)
             for layers in (1, 2) for tokens in (2, 4)}  # fmt: skip
    check = _walk_entries(layered[2], 6, walk)
    counts = {}
    for module in set().union(*walks.values(), check):
        e = {key: walk[module] for key, walk in walks.items()}
        per_token = {layers: (e[layers, 4] - e[layers, 2]) / 2 for layers in (1, 2)}
        at_zero = {layers: e[layers, 2] - 2 * per_token[layers] for layers in (1, 2)}
        per_layer_token = per_token[2] - per_token[1]
        per_layer = at_zero[2] - at_zero[1]
        parts = (at_zero[1] - per_layer, per_token[1] - per_layer_token, per_layer, per_layer_token)
        request, tok, layer, layer_tok = parts
        predicted = request + 6 * tok + 2 * layer + 12 * layer_tok
        assert predicted == check[module], f"{module}: not linear in tokens and layers"
        assert all(p == int(p) for p in parts), f"{module}: {parts}"
        counts[module] = tuple(int(p) for p in parts)
    return counts


@pytest.mark.unchecked_entries  # the entry check after each request would be counted too
@pytest.mark.parametrize("walk", list(_WALKS))
def test_one_prompt_enters_each_module_at_most_twice(layered, walk):
    counts = _separated(layered, walk)
    over = {}
    for module, (request, per_token, _, _) in counts.items():
        most_request, most_per_token = _OVER_BUDGET.get(module, ((_MAX_ENTRIES, _MAX_ENTRIES),))[0]
        if request > most_request or per_token > most_per_token:
            over[module] = (request, per_token)
    assert not over, f"entered more often than the budget (request, per token): {over}"


@pytest.mark.unchecked_entries
def test_the_walk_is_counted_the_same_way_twice(layered):
    """The counts are deterministic (greedy decoding, a fixed prompt)."""
    first = _walk_entries(layered[2], 4)
    assert first["mlxkv.runner.runner"] >= 1 and first["mlxkv.cache.model_cache"] >= 1
    assert _walk_entries(layered[2], 4) == first
