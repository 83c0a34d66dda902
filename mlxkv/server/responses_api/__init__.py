"""OpenAI's Responses API (`POST /v1/responses`), the one Codex CLI speaks."""
