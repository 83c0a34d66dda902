"""Prefill policy: which of a request's prompt tokens are fed, in which chunks, with which
checkpoints (`fill`), and which requests are prefilled together (`group`). The forward passes
themselves are `mlxkv.decoding.prefill.chunks` and `mlxkv.decoding.prefill.batched`.
"""
