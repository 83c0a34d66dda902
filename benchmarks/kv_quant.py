"""KV quantization: cache bytes and greedy token agreement over 256 tokens, kv_bits 8 and 4
against float K/V, on the same model and prompt."""

from __future__ import annotations

from benchmarks.common import token_prompt
from mlxkv import Runner
from mlxkv.models.loading import LoadedModel


def measure(loaded: LoadedModel, num_tokens: int) -> dict:
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    prompt = messages if loaded.tokenizer.chat_template else token_prompt(loaded, 64)
    reference = Runner(loaded)
    want = reference.generate(prompt, max_tokens=num_tokens)
    float_bytes = reference.cache_info().used_bytes
    rows = {"float": {"kv_used_bytes": float_bytes, "tokens": len(want.tokens)}}
    for bits in (8, 4):
        runner = Runner(loaded, kv_bits=bits)
        got = runner.generate(prompt, max_tokens=num_tokens)
        pairs = list(zip(got.tokens, want.tokens, strict=False))
        first_diff = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        rows[f"kv_bits={bits}"] = {
            "kv_used_bytes": runner.cache_info().used_bytes,
            "bytes_vs_float": runner.cache_info().used_bytes / float_bytes,
            "agreement": sum(a == b for a, b in pairs) / max(len(want.tokens), 1),
            "first_divergence": first_diff,
            "tokens": len(got.tokens),
        }
    return rows
