"""Disk-tier files that pass their checksums but lie about what they hold: a block's K/V with
more tokens than its token ids, of an integer dtype, with arrays no layer reads, or a header
whose shapes its data does not fill; every block's K/V of another shape than the model's; a
buffer step of no use. Each is refused when the directory is indexed (and
removed: it claims this tier's format), and the request answers as a fresh Runner does,
from the blocks before it. Before, the first two were joined to their neighbours and answered
wrongly, and the last was kept and retried on every request. A file named like a block whose
header is JSON nested too deep for Python stopped the Runner from starting; it is left alone
(nothing says it is this tier's)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv.runner.disk import files
from mlxkv.runner.disk import store as store_module
from mlxkv.runner.disk.files import CRC_PLACEHOLDER, SUFFIX, patch_crc
from tests.runner.test_disk_partial import (
    BLOCK_TOKENS,
    _answers_as_fresh,
    _full_chain,
    _stored_conversation,
)

DEEP = 100_000  # JSON arrays nested this deep: past Python's recursion limit


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(store_module, "BLOCK_TOKENS", BLOCK_TOKENS)


def _rewritten(path: Path, edit, edit_metadata=None) -> None:
    """`path` written again with its arrays as `edit` returns them (its metadata changed in
    place by `edit_metadata`), its CRCs made valid as the tier makes them (`patch_crc`); its
    name (its token ids) unchanged."""
    arrays, metadata = mx.load(str(path), return_metadata=True)
    arrays = edit(dict(arrays))
    if edit_metadata is not None:
        edit_metadata(metadata)
    _unsealed(metadata)
    scratch = path.with_name("edited" + SUFFIX)
    mx.save_safetensors(str(scratch), arrays, metadata)
    patch_crc(scratch)
    scratch.replace(path)


def _unsealed(metadata: dict) -> None:
    """The CRCs back to their placeholders, for `patch_crc` to fill in."""
    metadata["crc32"] = CRC_PLACEHOLDER
    metadata["sections"] = CRC_PLACEHOLDER * (len(metadata["sections"]) // len(CRC_PLACEHOLDER))


def _kv(arrays: dict, change) -> dict:
    return {name: change(a) if name.startswith("l.") else a for name, a in arrays.items()}


def _more_tokens(arrays: dict) -> dict:
    return _kv(arrays, lambda a: mx.concatenate([a, a[:, :, :4, :]], axis=2))


def _integers(arrays: dict) -> dict:
    return _kv(arrays, lambda a: (a * 100).astype(mx.int32))


def _packed(arrays: dict) -> dict:
    """Float K/V stored as uint32, the quantized layers' packed dtype."""
    return _kv(arrays, lambda a: (a * 100).astype(mx.uint32))


def _unread_array(arrays: dict) -> dict:
    return {**arrays, "l.0/unread": mx.zeros((4,))}


def _shapes_unfilled(path: Path) -> None:
    """Every K/V array's shape said twice the head size its bytes hold (its tokens right)."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    for name, array in header.items():
        if name.startswith("l."):
            array["shape"][3] *= 2
    _unsealed(header["__metadata__"])
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (size - len(text))  # the same length: every offset stays
    path.write_bytes(raw[:8] + text + raw[8 + size :])
    with pytest.MonkeyPatch.context() as patch:  # sealed as if the lie were the truth
        patch.setattr(files, "_check_span", lambda *_: None)
        patch_crc(path)


LIES = {
    "more-tokens-than-ids": lambda path: _rewritten(path, _more_tokens),
    "integer-kv": lambda path: _rewritten(path, _integers),
    "packed-kv-of-a-float-layer": lambda path: _rewritten(path, _packed),
    "an-array-no-layer-reads": lambda path: _rewritten(path, _unread_array),
    "shapes-the-data-does-not-fill": _shapes_unfilled,
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_block_that_lies_is_refused_and_the_answer_is_a_fresh_runners(
    make_runner, tmp_path, caplog, lie
):
    follow_up = _stored_conversation(make_runner, "llama", tmp_path)
    indexed = make_runner("llama", cache_dir=tmp_path)
    chain = _full_chain(indexed, follow_up)
    indexed.close()
    assert len(chain.blocks) >= 3
    j = len(chain.blocks) - 2  # a block in the middle
    bad = chain.blocks[j].path
    LIES[lie](bad)
    restarted = make_runner("llama", cache_dir=tmp_path)  # indexes the directory
    assert not bad.exists()  # refused and removed as the directory was read
    warnings = _answers_as_fresh(
        restarted, make_runner, "llama", follow_up, j * BLOCK_TOKENS, caplog
    )
    assert not any("Traceback" in w for w in warnings)


def _more_heads(arrays: dict) -> dict:
    return _kv(arrays, lambda a: mx.concatenate([a, a], axis=1))


def test_kv_of_another_shape_on_every_block_is_refused_against_the_models(
    make_runner, tmp_path, caplog
):
    """Every block's K/V with twice the model's heads: each block agrees with its own layout
    and token ids, and they join; before, every request restoring them failed in the model (a
    500 over HTTP) and the files stayed. Now each block is held to the model's own shapes:
    the first is refused (its chain with it), the answer is a fresh Runner's, and the
    conversation is written again whole."""
    follow_up = _stored_conversation(make_runner, "llama", tmp_path)
    indexed = make_runner("llama", cache_dir=tmp_path)
    chain = _full_chain(indexed, follow_up)
    indexed.close()
    lies = {}
    for block in chain.blocks:
        _rewritten(block.path, _more_heads)
        lies[block.path] = block.path.read_bytes()
    restarted = make_runner("llama", cache_dir=tmp_path)
    _answers_as_fresh(restarted, make_runner, "llama", follow_up, 0, caplog)
    restarted._pool.store.flush()  # this turn's blocks written again, whole
    assert not [path for path, lie in lies.items() if path.exists() and path.read_bytes() == lie]


def _step(step: str):
    """Every layer's buffer step in the layout said `step` (a K/V layer's only setting)."""

    def steps(metadata: dict) -> None:
        layout = json.loads(metadata["layout"])
        for entry in layout["layers"]:
            entry["meta"] = [step]
        metadata["layout"] = json.dumps(layout)

    return lambda path: _rewritten(path, lambda arrays: arrays, steps)


@pytest.mark.parametrize("step", ["0", "-256"])
def test_a_buffer_step_saved_is_the_models_own_when_restored(make_runner, tmp_path, caplog, step):
    """A layer's step is how its buffer grows, not state: a file's 0 divided by zero, a
    negative one broadcast wrong, 2**31 made MLX die allocating (not run here). The blocks are
    otherwise whole, so the chain is reused."""
    follow_up = _stored_conversation(make_runner, "llama", tmp_path)
    indexed = make_runner("llama", cache_dir=tmp_path)
    chain = _full_chain(indexed, follow_up)
    indexed.close()
    for block in chain.blocks:
        _step(step)(block.path)
    restarted = make_runner("llama", cache_dir=tmp_path)
    _answers_as_fresh(restarted, make_runner, "llama", follow_up, chain.num_tokens, caplog)


def test_a_header_nested_too_deep_is_left_alone_and_the_runner_starts(
    make_runner, tmp_path, caplog
):
    follow_up = _stored_conversation(make_runner, "llama", tmp_path)
    (directory,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    header = b"[" * DEEP + b"]" * DEEP
    stranger = directory / ("0" * 32 + SUFFIX)
    stranger.write_bytes(struct.pack("<Q", len(header)) + header)
    restarted = make_runner("llama", cache_dir=tmp_path)
    chain = _full_chain(restarted, follow_up)
    _answers_as_fresh(restarted, make_runner, "llama", follow_up, chain.num_tokens, caplog)
    assert stranger.read_bytes()[8:] == header  # not this tier's to remove
