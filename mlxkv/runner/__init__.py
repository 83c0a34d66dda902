"""The request path: `Runner` (load once, generate many), requests built and fitted to the
window, prefill of what the cache lacks, decoding, text and results, and keeping sharded
ranks in step.

Imports `decoding`, `models`, `cache` and `platform`; the CLI and the server build on it.
"""
