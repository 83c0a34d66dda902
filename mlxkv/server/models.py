"""Which served model a request names: several Runners behind one server, chosen by the
request's `model`.

Owns `ServedModels` (names -> generation workers, and alias patterns) and `request_context`
(the `ServerContext` of the model a request names, read from its body once). With one model
served, every name answers with it (agents whose model ids cannot be changed keep working);
with several, a name is matched exactly (Ollama's `:latest` tag ignored), then against the
alias patterns in order (`claude-*=coder`), else the request is a 404 listing the names served.
A request that names no model gets the first one. Does not own loading (every model is loaded
before the server starts) or the APIs' listings (each API folder).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from mlxkv.models.capabilities import model_capabilities
from mlxkv.server.errors import ApiError
from mlxkv.server.worker import GenerationWorker

_OLLAMA_TAG = ":latest"


class ServedModels:
    """Args:
    workers: each served model's name and worker, the default (first) model first.
    aliases: "PATTERN=NAME" entries (fnmatch patterns such as "claude-*") naming a served
        model for request names that match.

    Raises:
        ValueError: no model, an alias without "=", or one naming a model not served.
    """

    def __init__(self, workers: dict[str, GenerationWorker], aliases: Sequence[str] = ()):
        if not workers:
            raise ValueError("serve at least one model")
        self.workers = dict(workers)
        # what each model can do with tools and thinking, read once from its template
        self.capabilities = {
            name: model_capabilities(worker.runner.tokenizer) for name, worker in workers.items()
        }
        self.aliases: list[tuple[str, str]] = []
        for alias in aliases:
            pattern, _, name = alias.partition("=")
            if not pattern or name not in self.workers:
                raise ValueError(
                    f"alias {alias!r} must be PATTERN=NAME with NAME one of: {self.listed}"
                )
            self.aliases.append((pattern, name))

    @property
    def listed(self) -> str:
        return ", ".join(self.workers)

    def resolve(self, name: str | None) -> str:
        """The served model's name for a request's `model`.

        Raises:
            ApiError: 404 listing the names served, when several are and none matches.
        """
        if len(self.workers) == 1 or not name:
            return next(iter(self.workers))
        for candidate in (name, name.removesuffix(_OLLAMA_TAG)):
            if candidate in self.workers:
                return candidate
        for pattern, target in self.aliases:
            if fnmatch.fnmatchcase(name, pattern):
                return target
        raise ApiError(
            404, f"model '{name}' not found; this server serves: {self.listed}", param="model"
        )


async def request_context(request: Request) -> Any:
    """The app's `ServerContext` for the model the request's body names (kept on the
    request: read once, whoever asks first). GET requests get the default model's."""
    known = getattr(request.state, "mlxkv", None)
    if known is not None:
        return known
    base = request.app.state.mlxkv
    context = base
    if len(base.models.workers) > 1 and request.method == "POST":
        name = base.models.resolve(_named_model(await request.body()))
        context = dataclasses.replace(base, worker=base.models.workers[name], model_name=name)
    request.state.mlxkv = context
    return context


def _named_model(body: bytes) -> str | None:
    """The body's `model` (Ollama's older `name`); None for a body that is not a JSON object
    (its route answers that with a 400)."""
    try:
        parsed = json.loads(body or b"null")
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    name = parsed.get("model") or parsed.get("name")
    return name if isinstance(name, str) else None
