"""Ollama's `/api/embed` (`input`: a string or a list; `truncate`, on by default, cuts an input
over the window; `dimensions`) and the older `/api/embeddings` (`prompt`: one string, answered
as `embedding`). An empty input embeds nothing and answers at once, as Ollama does: clients
send one to load the model.

Reference: https://github.com/ollama/ollama/blob/main/docs/api.md#generate-embeddings
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from mlxkv.server.embeddings import embed
from mlxkv.server.ollama_api.protocol import Lenient

router = APIRouter(prefix="/api")


class EmbedRequest(Lenient):
    model: str = ""
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    keep_alive: Any = None


class EmbeddingsRequest(Lenient):
    model: str = ""
    prompt: str = ""
    keep_alive: Any = None


@router.post("/embed")
async def embed_inputs(body: EmbedRequest, request: Request) -> dict[str, Any]:
    started = time.perf_counter_ns()
    inputs = [body.input] if isinstance(body.input, str) else body.input
    inputs = [text for text in inputs if text]  # Ollama skips empty strings
    vectors, num_tokens = [], 0
    if inputs:
        result = await embed(request, inputs, dimensions=body.dimensions, truncate=body.truncate)
        vectors, num_tokens = result.vectors.tolist(), result.num_tokens
    return {
        "model": body.model,
        "embeddings": vectors,
        "total_duration": time.perf_counter_ns() - started,
        "load_duration": 0,
        "prompt_eval_count": num_tokens,
    }


@router.post("/embeddings")
async def embed_prompt(body: EmbeddingsRequest, request: Request) -> dict[str, Any]:
    if not body.prompt:
        return {"embedding": []}
    result = await embed(request, body.prompt, truncate=True)
    return {"embedding": result.vectors[0].tolist()}
