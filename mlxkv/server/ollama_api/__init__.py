"""Ollama's API (`/api/...`) on the same port, for Ollama clients (the `ollama` Python client,
`codex --oss`, Open WebUI's Ollama connection)."""
