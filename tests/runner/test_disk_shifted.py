"""The disk tier keeps a shift's mark: K/V a context shift approximated come back from disk
marked `shifted`, so nothing takes them for a prefill of their tokens."""

from __future__ import annotations

import pytest

from mlxkv.runner.hooks import request_ends

NO_EOS = {0: -100.0, 1: -100.0, 2: -100.0}


@pytest.mark.parametrize("block_tokens", [256, 16], ids=["one-block", "blocks-of-16"])
def test_a_shifted_entry_restored_from_disk_stays_marked_shifted(
    make_runner, tmp_path, block_tokens
):
    """An entry shifted in place, written to disk and restored by a restart, still holds the
    K/V the shift approximated: the restore is `shifted` (else `tests/invariants.py` holds it
    to a fresh prefill it cannot equal), whichever of its blocks carry the mark, and the
    tokens the shift kept exact restore exact."""
    before = make_runner("llama", max_context=64, cache_dir=tmp_path)
    before._pool.store.block_tokens = block_tokens
    before.generate(list(range(3, 43)), max_tokens=40, logit_bias=NO_EOS)
    held = before.cache_tokens
    assert before._pool.entries[0].cache.shifted
    before.close()

    after = make_runner("llama", max_context=64, cache_dir=tmp_path)
    ends = []
    with request_ends(ends.append):
        prompt = held + [7, 8]  # goes on from all it held: shifted K/V reused
        out = after.generate(prompt, max_tokens=2, logit_bias=NO_EOS)
    (end,) = ends
    assert out.cached_tokens == len(held)
    assert end.entry.cache.tokens[: len(prompt)] == prompt and end.entry.cache.shifted

    exact = make_runner("llama", max_context=64, cache_dir=tmp_path)
    ends.clear()
    with request_ends(ends.append):
        out = exact.generate(held[:4] + [7, 8], max_tokens=2, logit_bias=NO_EOS)
    (end,) = ends
    assert out.cached_tokens == 4 and not end.entry.cache.shifted
