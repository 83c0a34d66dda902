"""Prefill policy: which of a request's prompt tokens are fed, in which chunks, with which
checkpoints (`fill`), which requests are prefilled together (`group`), and a vision model's
rows with images in such a pass (`image_rows`). The forward passes themselves are
`mlxkv.decoding.prefill.chunks` and `mlxkv.decoding.prefill.batched`.
"""
