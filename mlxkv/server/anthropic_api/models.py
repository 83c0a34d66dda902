"""Anthropic's models listing: `GET /v1/models` and `/v1/models/{id}` asked by Anthropic's
clients, which send `anthropic-version` (OpenAI's clients call the same paths and get
OpenAI's listing, `openai_api.routes`).

Owns `AnthropicRoute` (a route only a request with that header matches, so the app includes
this router before OpenAI's) and the listing's shape: `{"data": [{"type": "model", "id",
"display_name", "created_at"}], "has_more", "first_id", "last_id"}`, paged as Anthropic's by
`limit` (1 to 1000, 20 by default), `after_id` and `before_id`. `created_at` is RFC 3339, the
server's start as OpenAI's `created` is.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.types import Scope

from mlxkv.server.errors import ApiError, is_anthropic_request
from mlxkv.server.state import Context, ServerContext


class AnthropicRoute(APIRoute):
    """Matches only Anthropic's requests (`errors.is_anthropic_request`); any other request
    passes on to the next route of the same path."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http" and not is_anthropic_request(scope):
            return Match.NONE, {}
        return super().matches(scope)


router = APIRouter(route_class=AnthropicRoute)


@router.get("/v1/models")
async def list_models(
    ctx: Context,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    after_id: str | None = None,
    before_id: str | None = None,
) -> dict[str, Any]:
    models = [_model_info(each) for each in ctx.each_model()]
    ids = [model["id"] for model in models]
    if before_id is not None:
        end = _cursor(ids, before_id, "before_id")
        start, has_more = max(0, end - limit), end > limit
    else:
        start = 0 if after_id is None else _cursor(ids, after_id, "after_id") + 1
        end = start + limit
        has_more = end < len(ids)
    page = models[start:end]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    return {"data": page, "has_more": has_more, "first_id": first, "last_id": last}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, ctx: Context) -> dict[str, Any]:
    """The listed object of the model `model_id` names, as a request's `model` may name it
    (an Ollama name, an alias), with the served name as its id."""
    name = ctx.models.find(model_id)
    if name is None:
        message = f"model: {model_id}; this server serves: {ctx.models.listed}"
        raise ApiError(404, message)
    return next(_model_info(each) for each in ctx.each_model() if each.model_name == name)


def _cursor(ids: list[str], model_id: str, param: str) -> int:
    if model_id not in ids:
        raise ApiError(400, f"{param}: no listed model is {model_id!r}; listed: {', '.join(ids)}")
    return ids.index(model_id)


def _model_info(each: ServerContext) -> dict[str, Any]:
    created = datetime.fromtimestamp(each.created, timezone.utc).isoformat()
    created = created.replace("+00:00", "Z")
    name = each.model_name
    return {"type": "model", "id": name, "display_name": name, "created_at": created}
