"""Prefill policy: which of a request's prompt tokens are fed, in which chunks, with which
checkpoints (`fill`), and which requests are prefilled together (`group`). The forward passes
themselves are `mlxkv.decoding.prefill` and `mlxkv.decoding.prefill_batched`.
"""
