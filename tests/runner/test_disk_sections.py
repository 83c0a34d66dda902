"""Format 5's per-layer checksums: one layer's section of one block damaged after the directory
was indexed stops the restore at the blocks before it, with one warning, and the request
answers as a fresh Runner does (log-probabilities compared)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from mlxkv.cache import gate
from mlxkv.runner.disk import reading
from mlxkv.runner.disk import store as store_module
from mlxkv.runner.disk.chains import partial_restores
from mlxkv.runner.disk.files import read_header
from tests.runner.test_disk_partial import (
    BLOCK_TOKENS,
    _answer,
    _answers_as_fresh,
    _full_chain,
    _stored_conversation,
)
from tests.tolerances import LOGPROB_ABS


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(store_module, "BLOCK_TOKENS", BLOCK_TOKENS)


def _flip_a_middle_block(restarted, follow_up):
    """Flips a byte in the last layer holding arrays of a block in the middle of the chain
    `follow_up` restores (blocks on both sides); returns the restore that stops before it, the
    block's path, that layer and the damaged bytes."""
    chain = _full_chain(restarted, follow_up)
    restores = partial_restores(chain, trimmable=restarted._pool.store.trimmable)
    assert len(chain.blocks) >= 3
    j = len(chain.blocks) - 2
    before = [r for r in restores if len(r.blocks) <= j][-1]
    bad = chain.blocks[j].path
    sections = read_header(bad).sections
    k = max(i for i, spans in enumerate(sections) if spans)
    assert k > 0  # the layers before it pass their checks
    start, end = sections[k][0]
    data = bytearray(bad.read_bytes())
    data[(start + end) // 2] ^= 0x40
    bad.write_bytes(bytes(data))
    return before, bad, k, data


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_flipped_byte_in_one_layer_of_one_block_keeps_the_blocks_before_it(
    make_runner, tmp_path, caplog, arch
):
    follow_up = _stored_conversation(make_runner, arch, tmp_path)
    restarted = make_runner(arch, cache_dir=tmp_path)  # the directory indexed whole
    before, bad, k, data = _flip_a_middle_block(restarted, follow_up)
    warnings = _answers_as_fresh(restarted, make_runner, arch, follow_up, before.num_tokens, caplog)
    assert [w for w in warnings if bad.name in w and f"layer {k} " in w] == warnings
    assert len(warnings) == 1
    restarted._pool.store.flush()  # removed, then written again by this turn, checked whole
    assert not bad.exists() or bytearray(bad.read_bytes()) != data
    if bad.exists():
        reading.checked_header(SimpleNamespace(path=bad))  # raises BadFile if corrupt


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_the_prefill_uses_the_first_layers_before_the_last_is_checked(
    make_runner, tmp_path, monkeypatch, arch
):
    """The last layer's check is held until the model asks for layer 1 of the restored cache
    (layer 0 computed meanwhile): a restore that checked every layer before the prefill would
    never get there (bounded: the hold gives up after 20 s), and the answer is a fresh
    Runner's."""
    follow_up = _stored_conversation(make_runner, arch, tmp_path)
    restarted = make_runner(arch, cache_dir=tmp_path)
    last = len(restarted._pool._make_entry()) - 1
    assert last >= 1
    layer_1_asked = threading.Event()
    held_until_asked = []
    real_check, real_item = reading.check_sections, gate.GatedLayers.__getitem__

    def held_check(path, header, layers):
        if list(layers) == [last] and not held_until_asked:
            held_until_asked.append(layer_1_asked.wait(20))
        return real_check(path, header, layers)

    def asked(self, index):
        if index == 1:
            layer_1_asked.set()
        return real_item(self, index)

    monkeypatch.setattr(reading, "check_sections", held_check)
    monkeypatch.setattr(gate.GatedLayers, "__getitem__", asked)
    got = _answer(restarted, follow_up)
    want = _answer(make_runner(arch), follow_up)
    assert held_until_asked == [True]
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS)
    assert got[2] > 0


def test_a_restore_written_back_before_its_checks_pass_writes_no_unchecked_layer(
    make_runner, tmp_path, caplog
):
    """An entry restored streamed and written back before any forward (a request that failed
    first, an eviction): its last block cut at a new length is a new file, so its layers must
    have passed their checks first; a corrupt one leaves the entry empty and writes nothing."""
    follow_up = _stored_conversation(make_runner, "llama", tmp_path)
    restarted = make_runner("llama", cache_dir=tmp_path)
    store = restarted._pool.store
    chain = _full_chain(restarted, follow_up)
    bad = chain.blocks[-1].path
    start, end = read_header(bad).sections[-1][0]  # the last layer of the last block
    data = bytearray(bad.read_bytes())
    data[(start + end) // 2] ^= 0x40
    bad.write_bytes(bytes(data))
    files_before = sorted(p.name for p in tmp_path.rglob("*.safetensors"))

    def restore_and_write_back():
        cache = store.load(chain, restarted._make_entry(), streamed=True)
        cache.rewind_to(cache.num_tokens - 1)  # its last block now ends elsewhere: a new key
        store.write(cache, wait=True)
        return cache.num_tokens

    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        assert restarted._engine.call(restore_and_write_back) == 0
    assert sorted(p.name for p in tmp_path.rglob("*.safetensors")) == [
        name
        for name in files_before
        if name != bad.name  # the corrupt block is removed
    ]


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_the_usage_matched_reports_is_the_replys_when_a_streamed_restore_breaks(
    make_runner, tmp_path, arch
):
    """`matched` (Anthropic's `message_start`) reports the usage once the restore's checks
    passed or it was loaded again: what the reply's usage says, never the tokens the broken
    block would have supplied (was 157 cached against the reply's 128 on llama)."""
    follow_up = _stored_conversation(make_runner, arch, tmp_path)
    restarted = make_runner(arch, cache_dir=tmp_path)
    before, _, _, _ = _flip_a_middle_block(restarted, follow_up)
    seen = []
    chunks = list(restarted.stream(follow_up, max_tokens=2, temperature=0, matched=seen.append))
    done = chunks[-1].completion
    assert len(seen) == 1
    assert (seen[0].prompt_tokens, seen[0].cached_tokens) == (
        done.prompt_tokens,
        done.cached_tokens,
    )
    assert 0 < done.cached_tokens <= before.num_tokens
