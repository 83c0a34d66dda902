"""The throughput benchmark (`python -m benchmarks.run`, issue 5) compares mlxkv's decode with
`mlx_lm.stream_generate`'s plain decode, to show that no overhead of ours shows. Since
speculative decoding became the Runner's default ("auto"), its Runner drafted on the
benchmark's repeating greedy replies (SmolLM2: 33 of 64 tokens accepted from drafts), so the
ratio measured speculation instead. The tiny model's replies draft nothing here, so the mode
each request ran with is checked too."""

from __future__ import annotations

from benchmarks import throughput
from mlxkv import Runner


def test_decode_is_compared_without_speculation(loaded_tiny, monkeypatch):
    drafted, modes = [], []
    stream = Runner.stream

    def recording(self, *args, **kwargs):
        modes.append(kwargs.get("speculative", self.config.speculative))
        for chunk in stream(self, *args, **kwargs):
            if chunk.completion is not None:
                drafted.append(chunk.completion.drafted_tokens)
            yield chunk

    monkeypatch.setattr(Runner, "stream", recording)
    result = throughput.measure(loaded_tiny("llama"), [16], decode_tokens=32, reps=1)
    assert result["decode"]["ratio"] > 0
    assert drafted and not any(drafted), drafted
    assert set(modes) == {None}, modes
