"""Models: where they come from, loading them (directories, GGUF, Ollama, the hub), their
fingerprint, and sharding them over processes.

Imports `cache` and `platform` only: the engine builds on this package, never the reverse.
"""
