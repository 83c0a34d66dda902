"""Which served model a request names: several models behind one server, chosen by the
request's `model`, each loaded while requests use it (`resident.py`).

Owns `ServedModels` (names -> `ResidentModel`s, and alias patterns), `request_context` (the
`ServerContext` of the model a request names, read from its body once, with that model loaded
and held for the request) and `ReleaseModels` (the middleware that lets the model go when the
request's response and generation have ended, with the body's `keep_alive`). With one model
served, every name answers with it (agents whose model ids cannot be changed keep working);
with several, a name is matched exactly (Ollama's `:latest` tag ignored, or added to a name
without a tag, as Ollama reads "llama3.2" as "llama3.2:latest"), then against the
alias patterns in order (`claude-*=coder`), else the request is a 404 listing the names served.
A request that names no model gets the first one; a GET loads nothing (the listings read what
is loaded). Does not own the APIs' listings (each API folder).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxkv.runner.runner import Runner
from mlxkv.server.errors import ApiError
from mlxkv.server.models.keep_alive import FOREVER, keep_alive_ns
from mlxkv.server.models.model import ModelLoader, ResidentModel
from mlxkv.server.models.resident import Residency
from mlxkv.server.worker import GenerationWorker

_OLLAMA_TAG = ":latest"


def ollama_name(name: str) -> str:
    """A served model's name as Ollama lists it: "name:latest", or as it is where it holds a
    tag already (a model pulled with Ollama, served as "llama3.2:1b")."""
    return name if ":" in name.rsplit("/", 1)[-1] else name + _OLLAMA_TAG


class ServedModels:
    """Args:
    sources: each served model's name and Runner (loaded: it stays) or `ModelLoader`
        (loaded on its first request), the default (first) model first.
    make_worker: a worker for a Runner once loaded.
    aliases: "PATTERN=NAME" entries (fnmatch patterns such as "claude-*") naming a served
        model for request names that match.
    budget_bytes: most bytes the loaded models may take together (`resident.Residency`).
    keep_alive_s: seconds an idle model stays loaded by default (negative: for good).

    Raises:
        ValueError: no model, an alias without "=", or one naming a model not served.
    """

    def __init__(
        self,
        sources: Mapping[str, Runner | ModelLoader],
        make_worker: Callable[[Runner], GenerationWorker],
        aliases: Sequence[str] = (),
        budget_bytes: int | None = None,
        keep_alive_s: float = -1,
    ):
        if not sources:
            raise ValueError("serve at least one model")
        self.resident = {name: ResidentModel(name, source) for name, source in sources.items()}
        self.residency = Residency(
            list(self.resident.values()), make_worker, budget_bytes, keep_alive_s
        )
        self.aliases: list[tuple[str, str]] = []
        for alias in aliases:
            pattern, _, name = alias.partition("=")
            if not pattern or name not in self.resident:
                raise ValueError(
                    f"alias {alias!r} must be PATTERN=NAME with NAME one of: {self.listed}"
                )
            self.aliases.append((pattern, name))

    @property
    def listed(self) -> str:
        return ", ".join(self.resident)

    def resolve(self, name: str | None) -> str:
        """The served model's name for a request's `model`.

        Raises:
            ApiError: 404 listing the names served, when several are and none matches.
        """
        if len(self.resident) == 1 or not name:
            return next(iter(self.resident))
        found = self.find(name)
        if found is None:
            message = f"model '{name}' not found; this server serves: {self.listed}"
            raise ApiError(404, message, code="model_not_found", param="model")
        return found

    def find(self, name: str) -> str | None:
        """The served model `name` names (its own name, an Ollama name or tag, an alias), or
        None. Unlike `resolve`, a lone served model does not answer to every name: a lookup
        by name (`/v1/models/{id}`) says whether that name is served."""
        for candidate in (name, name.removesuffix(_OLLAMA_TAG), ollama_name(name)):
            if candidate in self.resident:
                return candidate
        for pattern, target in self.aliases:
            if fnmatch.fnmatchcase(name, pattern):
                return target
        return None


async def request_context(request: Request) -> Any:
    """The app's `ServerContext` for the model the request's body names (kept on the request:
    read once, whoever asks first). A POST loads that model if needed and holds it loaded
    until `ReleaseModels` sees the request end; a GET gets the default model's as it is now
    (its worker None while it is not loaded)."""
    known = getattr(request.state, "mlxkv", None)
    if known is not None:
        return known
    base = request.app.state.mlxkv
    models: ServedModels = base.models
    context = dataclasses.replace(base, worker=models.resident[base.model_name].worker)
    if request.method == "POST":
        fixed = len(models.resident) == 1 and models.resident[base.model_name].pinned
        body = {} if fixed else body_object(await request.body())  # one name, no keep-alive
        name = models.resolve(named_model(body))
        model = models.resident[name]
        loading, started_ns = model.worker is None, time.perf_counter_ns()
        worker = await models.residency.acquire(model)
        # held from here: released however the request ends
        request.state.mlxkv_release = (model, _keep_alive_s(body))
        load_ns = time.perf_counter_ns() - started_ns if loading else 0
        context = dataclasses.replace(
            base, worker=worker, model_name=name, load_duration_ns=load_ns
        )
    request.state.mlxkv = context
    return context


def named_context(request: Request, name: str | None) -> Any:
    """The app's `ServerContext` for the served model `name` as it is now (its worker None
    while not loaded): nothing loads for it (Ollama's `/api/show`).

    Raises:
        ApiError: 404 listing the names served, for a name none matches.
    """
    base = request.app.state.mlxkv
    served = base.models.resolve(name)
    return dataclasses.replace(base, worker=base.models.resident[served].worker, model_name=served)


def unload_named(request: Request, name: str | None) -> str:
    """Ollama's unload request for the model `name` means: unloaded now if loaded and idle,
    else as its last request or its load ends; never loaded for it. Returns the served
    model's name.

    Raises:
        ApiError: 404 listing the names served, for a name none matches.
    """
    models: ServedModels = request.app.state.mlxkv.models
    served = models.resolve(name)
    models.residency.unload_when_idle(models.resident[served])
    return served


def outliving_hold(request: Request) -> Callable[[], None]:
    """Hands the request's hold on its model (`request_context`) and its turn to work that
    outlives the request (a background response): its end neither waits for the turn (the
    access line, `ReleaseModels`) nor releases the model; the returned call does, once. The
    hold is taken here and released there because only that work knows when it ends: held by
    the request, the model could unload under it (`keep_alive` 0, another model's load), and
    the request's task would live on (a server's stop waits for it) to release it."""
    state = request.scope.setdefault("state", {})
    held = state.pop("mlxkv_release", None)
    state.pop("turn", None)
    residency: Residency = request.app.state.mlxkv.models.residency

    def release() -> None:
        nonlocal held
        if held is not None:
            model, keep_alive_s = held
            held = None
            residency.release(model, keep_alive_s)

    return release


class ReleaseModels:
    """ASGI middleware: once a request's response has ended, and its generation with it (a
    client that left: within a step), the model it held may unload (`Residency.release`),
    and the request keeps nothing of it: uvicorn holds a connection's last request (its scope)
    while the connection stays open, as SDK clients keep theirs, and a model reached from it
    (its context, its turn) would stay in memory after it unloaded."""

    def __init__(self, app: ASGIApp, models: ServedModels):
        self.app = app
        self.models = models

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            state = scope.get("state", {})
            held = state.pop("mlxkv_release", None)
            try:
                turn = state.get("turn")
                if held is not None and turn is not None:
                    await turn.finished()
            finally:
                for reaching_the_model in ("mlxkv", "turn"):
                    state.pop(reaching_the_model, None)
                if held is not None:
                    self.models.residency.release(*held)


def body_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; empty for one that is not (its route answers with a 400)."""
    try:
        parsed = json.loads(body or b"null")
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def named_model(body: dict[str, Any]) -> str | None:
    """The body's `model` (Ollama's older `name`)."""
    name = body.get("model") or body.get("name")
    return name if isinstance(name, str) else None


def _keep_alive_s(body: dict[str, Any]) -> float | None:
    """Ollama's `keep_alive` in seconds (negative: for good); None when not sent, or sent
    wrong (the route answers that with Ollama's 400)."""
    try:
        ns = keep_alive_ns(body.get("keep_alive"))
    except ValueError:
        return None
    if ns is None:
        return None
    return -1.0 if ns == FOREVER else ns / 1e9
