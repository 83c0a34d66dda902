"""Running the model on a cache: prefill in chunks (over CPU lanes), sampling, plain decoding
and speculative decoding with its drafters.

Imports `models`, `cache` and `platform` only; knows nothing of requests or text (`engine`).
"""
