"""Models: where they come from, loading them (directories, GGUF, Ollama, the hub;
vision-language models through mlx-vlm), their fingerprint and capabilities, embeddings, and
sharding them over processes.

Imports `cache` and `platform` only: `decoding` and `runner` build on this package, never the
reverse.
"""
