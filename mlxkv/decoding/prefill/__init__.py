"""Prefill mechanism: prompt tokens fed into a ModelCache in chunks (`chunks`), each chunk spread
over CPU streams on MLX's CPU backend (`lanes`), and prompts of several requests fed in one
batched pass (`batched`). Which tokens to feed, and with whom, is the runner's policy
(`mlxkv.runner.prefill`).
"""
