"""The request path: `Runner` (load once, generate many), requests built and fitted to the
window, prefill of what the cache lacks, decoding, text and results, and keeping sharded
ranks in step. It owns the prompt cache: the pool of entries, their budget and the memory
report (`prompt_cache/`), and the disk tier (`disk/`).

Imports `decoding`, `models`, `cache` and `platform`; the CLI and the server build on it.
"""
