"""Running the model on a cache: prefill (`prefill/`: in chunks, over CPU lanes, several prompts
in one batched pass), sampling and the token picker, plain, batched and speculative decoding
with its drafters, grammars, and the named `pause`; `decoders` chooses a reply's decoder once.

Imports `models`, `cache` and `platform` only; knows nothing of requests or text (those are
`mlxkv.runner`'s).
"""
