"""An HTTP server over a Runner (`mlxkv serve`): OpenAI's chat, completions and Responses APIs,
Anthropic's and Ollama's.

Owns HTTP only: requests become Runner calls and results become each API's responses. Cache
policy stays in the Runner.
"""

from mlxkv.server.app import create_app

__all__ = ["create_app"]
