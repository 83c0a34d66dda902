"""OpenAI's `/v1/embeddings`: one or several inputs (strings or token ids) to unit vectors, as
floats or as base64 (little-endian float32, what the `openai` client asks for by default and
decodes), `dimensions` for a shorter vector, `usage` counting the tokens embedded.

Reference: https://platform.openai.com/docs/api-reference/embeddings/create
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import Field

from mlxkv.server.embeddings import embed
from mlxkv.server.protocol import Lenient
from mlxkv.server.state import Context

router = APIRouter()


class EmbeddingRequest(Lenient):
    model: str = ""
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, ctx: Context) -> dict[str, Any]:
    result = await embed(request, body.input, dimensions=body.dimensions)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)}
        for i, vector in enumerate(result.vectors)
    ]
    usage = {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}
    return {"object": "list", "data": data, "model": ctx.model_name, "usage": usage}


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
