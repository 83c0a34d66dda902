"""A decode batch against each sequence decoded alone, under any schedule of joins, reads and
early leaves: the same greedy tokens and log-probabilities (within the batched kernels'
rounding), and every entry afterwards holds exactly the tokens it fed, with the K/V a fresh
prefill of them gives. Quantized K/V (`kv_bits` 8 and 4) against each row alone on the same
`kv_bits`: both sides quantize the same values, so the float bounds hold (measured: equal
log-probabilities on this CPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxkv.cache.batched import BatchedKV, can_batch
from mlxkv.cache.batched_quantized import BatchQuantizedKVCache
from mlxkv.cache.building import make_cache
from mlxkv.cache.layers.quantized import QuantizedKVCache
from mlxkv.cache.layers.window import SlidingWindowCache
from mlxkv.decoding.batch import DecodeBatch, batched_tokens, joined_tokens
from mlxkv.decoding.pause import PAUSE
from mlxkv.decoding.picker import TokenPicker
from mlxkv.decoding.plain import decode_tokens
from mlxkv.decoding.prefill.chunks import PrefillPlan, prefill
from mlxkv.decoding.sampling import SamplingParams
from tests.tolerances import LOGPROB_ABS, assert_logits_close, logprob_rel

PROMPTS = [[3, 17, 5, 99, 42], [7] * 3, list(range(40, 71)), [11, 12]]
MAX_TOKENS = [9, 5, 12, 1]
PLAN = PrefillPlan(512)


QUANTIZED = {"kv_group_size": 64}  # the quantizable llama's head dimension is 64


def _make_cache(model, kv_bits=None):
    return make_cache(model, kv_bits=kv_bits, **QUANTIZED) if kv_bits else make_cache(model)


def _start(model, prompt, kv_bits=None):
    """A cache holding `prompt` (K/V quantized to `kv_bits`), the last logits, and a greedy
    picker keeping logprobs."""
    cache = _make_cache(model, kv_bits)
    logits = prefill(model, cache, prompt, PLAN)
    params = SamplingParams(temperature=0.0)
    pick = TokenPicker(params.make_sampler(512), [], prompt, top_logprobs=0)
    return cache, logits, pick


def _alone(model, prompt, max_tokens, kv_bits=None):
    cache, logits, pick = _start(model, prompt, kv_bits)
    tokens = list(decode_tokens(model, cache, logits, pick, max_tokens))
    return tokens, [pick.pop_logprob().logprob for _ in tokens]


def _model_and_alone(model, kv_bits=None):
    """(model, each prompt decoded alone, kv_bits)."""
    zipped = zip(PROMPTS, MAX_TOKENS, strict=True)
    return model, [_alone(model, p, n, kv_bits) for p, n in zipped], kv_bits


@pytest.fixture(scope="module")
def llama(loaded_tiny):
    return _model_and_alone(loaded_tiny("llama").model)[:2]


# every kind of layer that batches: float K/V; sliding windows of 8 tokens beside global layers
# (gemma3_text) or alone (spark2_5), wrapping in these sequences; recurrent state beside
# attention (lfm2) or alone (mamba); K/V quantized to 8 and 4 bits (llama-q8, llama-q4)
@pytest.fixture(
    scope="module",
    params=["llama", "gemma3_text", "spark2_5", "lfm2", "mamba", "llama-q8", "llama-q4"],
)
def any_kind(loaded_tiny, loaded_quantizable, request):
    if request.param.startswith("llama-q"):
        return _model_and_alone(loaded_quantizable.model, int(request.param[len("llama-q") :]))
    return _model_and_alone(loaded_tiny(request.param).model)


def _assert_holds_what_it_fed(model, cache, prompt, streamed, continuation, kv_bits=None):
    """The entry holds the prompt, then the tokens streamed (all but maybe the last; what the
    row decoded ahead of a slow reader is given back, unless a window has already lost what
    the shorter length needs), the row's own greedy continuation; and its layers are a fresh
    prefill's (the next token's logits on both agree)."""
    held = cache.tokens
    assert held[: len(prompt)] == prompt
    fed = held[len(prompt) :]
    assert fed == continuation[: len(fed)]
    assert len(streamed) - 1 <= len(fed)
    if len(fed) > len(streamed):  # decoded ahead and kept: only a window that cannot go back
        assert not cache.can_trim_to(len(prompt) + len(streamed))
        assert any(type(layer).__name__ == "SlidingWindowCache" for layer in cache.layers)
    fresh = _make_cache(model, kv_bits)
    prefill(model, fresh, held, PLAN)
    want = fresh.forward(model, [1])
    got = cache.copy().forward(model, [1])
    what = "a batched row's layers against a fresh prefill"
    assert_logits_close(got, want, what, kv_bits=kv_bits)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    schedule=st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=4, max_size=60),
    leave_after=st.lists(st.one_of(st.none(), st.integers(1, 6)), min_size=4, max_size=4),
)
def test_any_schedule_decodes_as_alone(any_kind, schedule, leave_after):
    """`schedule`: (sequence, stop it now) steps; a sequence starts at its first step, reads
    one token per step, and stops early when asked (or after `leave_after` tokens)."""
    model, alone, kv_bits = any_kind
    batch = DecodeBatch(model, max_rows=4)
    running, done = {}, {}
    for i, stop in schedule + [(i, False) for i in range(4) for _ in range(13)]:
        if i in done:
            continue
        if i not in running:
            cache, logits, pick = _start(model, PROMPTS[i], kv_bits)
            tokens = batched_tokens(batch, cache, logits, pick, MAX_TOKENS[i])
            running[i] = (cache, pick, tokens, [])
        cache, pick, tokens, streamed = running[i]
        token = next(tokens, None)
        if token is not None:
            streamed.append(token)
        limit = leave_after[i]
        if token is None or stop or (limit is not None and len(streamed) >= limit):
            tokens.close()
            done[i] = running.pop(i)
    assert batch.num_rows == 0 and batch.nbytes == 0
    for i, (cache, pick, _, streamed) in done.items():
        want_tokens, want_logprobs = alone[i]
        assert streamed == want_tokens[: len(streamed)]
        got_logprobs = [pick.pop_logprob().logprob for _ in streamed]
        want = pytest.approx(
            want_logprobs[: len(streamed)], abs=LOGPROB_ABS, rel=logprob_rel(kv_bits)
        )
        assert got_logprobs == want
        _assert_holds_what_it_fed(model, cache, PROMPTS[i], streamed, want_tokens, kv_bits)


@pytest.fixture(scope="module", params=["llama", "gemma3_text-q8"])
def float_or_mixed(llama, model_root, request):
    """The float llama; Gemma 3 (head size 64) with its global layers' K/V quantized to 8
    bits beside its float sliding windows, both batched classes in one step."""
    if request.param == "llama":
        return (*llama, None)
    from mlx_lm import load

    from mlxkv.testing.factory import build_model

    path = build_model(
        "gemma3_text", f"{model_root}/gemma3-hd64", config_overrides={"head_dim": 64}
    )
    return _model_and_alone(load(str(path))[0], 8)


def test_rows_that_join_and_leave_keep_the_others_exact(float_or_mixed):
    """Two rows in step, a third joining late and one leaving early: every row's tokens are
    its own alone (the padding a late row brings never leaks into another's attention)."""
    model, alone, kv_bits = float_or_mixed
    batch = DecodeBatch(model, max_rows=4)
    streams = {}
    for i in (0, 2):
        cache, logits, pick = _start(model, PROMPTS[i], kv_bits)
        streams[i] = (cache, batched_tokens(batch, cache, logits, pick, MAX_TOKENS[i]), [])
    for _ in range(3):
        for i in (0, 2):
            streams[i][2].append(next(streams[i][1]))
    cache, logits, pick = _start(model, PROMPTS[1], kv_bits)
    streams[1] = (cache, batched_tokens(batch, cache, logits, pick, MAX_TOKENS[1]), [])
    streams[0][1].close()  # leaves early
    for i in (1, 2):
        streams[i][2].extend(streams[i][1])
    for i, (cache, _, streamed) in streams.items():
        assert streamed == alone[i][0][: len(streamed)]
        _assert_holds_what_it_fed(model, cache, PROMPTS[i], streamed, alone[i][0], kv_bits)
    assert len(streams[2][2]) == MAX_TOKENS[2] and len(streams[1][2]) == MAX_TOKENS[1]


def _two_started(model):
    """A batch and the streams of prompts 0 and 2 on it, each past its first token (read
    before its row joins), with their caches."""
    batch = DecodeBatch(model, max_rows=4)
    caches, streams = [], []
    for i in (0, 2):
        cache, logits, pick = _start(model, PROMPTS[i])
        caches.append(cache)
        streams.append(batched_tokens(batch, cache, logits, pick, MAX_TOKENS[i]))
        next(streams[-1])
    return batch, caches, streams


@pytest.fixture(params=["llama", "gemma3_text", "lfm2"])
def model_of_a_kind(loaded_tiny, request):
    """Float K/V; sliding windows beside global layers; recurrent state beside attention."""
    return loaded_tiny(request.param).model


def _assert_as_joined(model, caches):
    for cache, prompt in zip(caches, (PROMPTS[0], PROMPTS[2]), strict=True):
        assert cache.tokens == prompt
        _assert_holds_what_it_fed(model, cache, prompt, [], [])  # its layers untouched too


def test_a_failed_step_leaves_every_entry_as_it_joined(model_of_a_kind):
    model = model_of_a_kind
    batch, caches, streams = _two_started(model)
    batch._model = _raising
    with pytest.raises(RuntimeError, match="broken step"):
        next(streams[0])
    with pytest.raises(RuntimeError, match="broken step"):
        next(streams[1])
    _assert_as_joined(model, caches)
    assert batch.num_rows == 0


def _raising(*args, **kwargs):
    raise RuntimeError("broken step")


def test_a_row_whose_processors_fail_ends_alone_and_the_other_goes_on(model_of_a_kind):
    """A grammar the engine gives up on raises inside one row's pick, after the forward pass
    fed every row: that row ends with the error, its entry holding exactly what it was fed;
    the other row goes on to its end as alone (one client's grammar ended every reply in the
    batch)."""
    model = model_of_a_kind
    alone = [_alone(model, PROMPTS[i], MAX_TOKENS[i])[0] for i in (0, 2)]
    batch, caches, streams = _two_started(model)  # each stream's first token read
    read = [[alone[0][0], next(streams[0])], [alone[1][0], next(streams[1])]]
    batch._rows[1].pick = TokenPicker(_raising, [_raising], [])  # a processor that fails
    with pytest.raises(RuntimeError, match="broken step"):
        for _ in range(MAX_TOKENS[2]):
            read[1].append(next(streams[1]))
    read[0] += list(streams[0])
    streams[1].close()
    assert read[0] == alone[0] and read[1] == alone[1][: len(read[1])]
    for cache, prompt, streamed, own in zip(
        caches, (PROMPTS[0], PROMPTS[2]), read, alone, strict=True
    ):
        _assert_holds_what_it_fed(model, cache, prompt, streamed, own)
    assert batch.num_rows == 0


def test_windows_with_sinks_cannot_batch(loaded_tiny):
    """mlx-lm's `BatchRotatingKVCache` keeps no sink tokens (`keep`)."""
    model = loaded_tiny("gemma3_text").model
    cache = make_cache(model)
    assert can_batch(cache) and DecodeBatch(model, 4).accepts(cache)
    cache.layers[0] = SlidingWindowCache(8, keep=2)
    assert not can_batch(cache)
    assert not DecodeBatch(model, 4).accepts(cache)
    with pytest.raises(ValueError, match="whose layers batch"):
        BatchedKV().join(cache)


def test_quantized_rows_join_as_quantized_kv_and_part_back_unchanged(loaded_quantizable):
    """A `kv_bits` entry's layers join as `BatchQuantizedKVCache` (its `bits` sends mlx-lm's
    attention down the quantized path), the shorter row left-padded, and part back as the
    entry's `QuantizedKVCache`: the same quantized arrays, bits and growth step."""
    model = loaded_quantizable.model
    caches = [_start(model, prompt, 4)[0] for prompt in PROMPTS[:2]]  # 5 and 3 tokens
    batched = BatchedKV()
    for cache in caches:
        assert can_batch(cache)
        batched.join(cache)
    layer = batched.layers[0]
    assert type(layer) is BatchQuantizedKVCache and (layer.bits, layer.group_size) == (4, 64)
    assert layer.left_padding.tolist() == [0, 2] and layer.offset.tolist() == [5, 3]
    own = caches[1].layers[0]
    parted = batched.part(1, caches[1].layers)[0]
    assert type(parted) is QuantizedKVCache
    assert (parted.bits, parted.group_size, parted.step) == (own.bits, own.group_size, own.step)
    for got, want in zip(parted.state, own.state, strict=True):
        assert all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True))
    assert batched.layers[0].left_padding.tolist() == [0]


def test_rows_joining_while_other_work_waits_pause_once_and_share_their_first_step(
    llama, monkeypatch
):
    """Rows joining one after the other while other work waits on the engine thread (the
    requests of one prefill group): each pauses once on joining instead of stepping with
    part of the batch, so the first step runs every row; the tokens are still their own."""
    model, alone = llama
    steps: list[int] = []
    step = DecodeBatch._step
    monkeypatch.setattr(
        DecodeBatch, "_step", lambda self: (steps.append(self.num_rows), step(self))[1]
    )
    batch = DecodeBatch(model, max_rows=4, others_waiting=lambda: True)
    streams = {}
    for i in (0, 2):
        cache, logits, pick = _start(model, PROMPTS[i])
        stream = batched_tokens(batch, cache, logits, pick, MAX_TOKENS[i])
        streams[i] = (cache, stream, [next(stream)])  # the first token, before joining
    for _, stream, _ in streams.values():
        assert next(stream) is PAUSE  # joined, paused once
    for i, (cache, stream, streamed) in streams.items():
        streamed.extend(stream)
        assert PAUSE not in streamed and streamed == alone[i][0]
        _assert_holds_what_it_fed(model, cache, PROMPTS[i], streamed, alone[i][0])
    assert steps[0] == 2


def test_a_step_is_read_back_once_for_all_its_rows(llama, monkeypatch):
    """Greedy rows that keep no log-probabilities (picked by one argmax for all): their tokens
    are the ones each decodes alone, and each step's tokens come back to the host in one read,
    not one per row (each read waits for the device)."""
    import mlxkv.decoding.batch as batch_module

    model, alone = llama
    reads = []

    class Counted(batch_module._Picked):
        def id(self, row):
            if self._ids is None:
                reads.append(self)
            return super().id(row)

    monkeypatch.setattr(batch_module, "_Picked", Counted)
    batch = DecodeBatch(model, max_rows=3)
    sequences = []
    for prompt in PROMPTS[:3]:
        cache, logits, _ = _start(model, prompt)
        pick = TokenPicker(
            SamplingParams(temperature=0.0).make_sampler(512), [], prompt, greedy=True
        )
        assert pick.bare_argmax
        sequences.append(batched_tokens(batch, cache, logits, pick, 5))
    streamed = [[next(tokens)] for tokens in sequences]  # the first tokens, before any step
    for _ in range(4):
        for tokens, out in zip(sequences, streamed, strict=True):
            out.append(next(tokens))
    assert streamed == [tokens[:5] for tokens, _ in alone[:3]]
    # One read per step, whatever its rows, and the token each row joined with, read as it
    # leaves (its entry's record).
    assert len(reads) == batch._steps + len(sequences)


def test_a_window_gone_back_one_token_joins_and_decodes_as_alone(loaded_tiny):
    """A full window trimmed back one token holds one slot fewer than mlx-lm's batched window
    takes from it: that slot must be padding (masked, never parted), not a zero key."""
    model = loaded_tiny("gemma3_text").model
    prompt = PROMPTS[2]  # 31 tokens, past the window of 8
    want_tokens, want_logprobs = _alone(model, prompt, 12)
    cache, logits, pick = _start(model, prompt)
    list(decode_tokens(model, cache, logits, pick, 4))  # the window wraps: 8 slots held
    held = cache.tokens
    cache.trim_to(len(held) - 1)
    window = cache.layers[0]
    assert isinstance(window, SlidingWindowCache) and window.size() == window.window - 1
    batch = DecodeBatch(model, max_rows=2)
    other, other_logits, other_pick = _start(model, PROMPTS[0])
    first_stream = batched_tokens(batch, other, other_logits, other_pick, 6)
    next(first_stream)  # a row of another length joined first
    batch.leave(batch.join(cache, mx.array([held[-1]]), pick, 5))  # in and out, no step
    assert window is not cache.layers[0] and cache.layers[0].size() == window.window - 1
    done = len(held) - 1 - len(prompt)
    got = list(joined_tokens(batch, cache, mx.array([held[-1]]), pick, 5))
    assert got == want_tokens[done + 1 : done + 6]
    got_logprobs = [pick.pop_logprob().logprob for _ in range(4 + len(got))][4:]
    assert got_logprobs == pytest.approx(want_logprobs[done + 1 : done + 6], abs=LOGPROB_ABS)
    first_stream.close()
