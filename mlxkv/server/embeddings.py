"""Embeddings over HTTP, whatever the API: the Runner's work run off the event loop, and its
errors as 400s that say what to fix.

Owns `embed`, which the OpenAI (`/v1/embeddings`) and Ollama (`/api/embed`, `/api/embeddings`)
routes call; each API shapes its own body. Lives apart from every API folder, so none imports
another.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from mlxkv.errors import (
    ContextLengthError,
    ModelInputError,
    ModelNotSupportedError,
    NotSupportedError,
)
from mlxkv.models.embedding import EmbeddingInput, Embeddings
from mlxkv.server.errors import ApiError
from mlxkv.server.models.served import request_context

# Most inputs one request embeds, OpenAI's limit
# (https://platform.openai.com/docs/api-reference/embeddings/create).
# Each vector is answered as JSON floats: unbounded, a 760 KB body of 190,000 one-letter
# inputs took a 64-wide tiny model's server from 0.1 to 7.9 GiB.
MAX_EMBEDDING_INPUTS = 2048


async def embed(
    request: Request,
    inputs: EmbeddingInput | Sequence[EmbeddingInput],
    *,
    dimensions: int | None = None,
    truncate: bool = False,
) -> Embeddings:
    """`Runner.embed` for an HTTP request (on a worker thread: tokenizing and the forward
    passes take a while; the model work itself interleaves with running generations).

    Raises:
        ApiError: 400 for bad input, more than `MAX_EMBEDDING_INPUTS` inputs, an input over
            the window (unless `truncate`), or a model that cannot compute embeddings (the
            message names it).
    """
    listed = isinstance(inputs, list) and inputs and not isinstance(inputs[0], int)
    num_inputs = len(inputs) if listed else 1
    if num_inputs > MAX_EMBEDDING_INPUTS:
        raise ApiError(
            400,
            f"the request holds {num_inputs:,} inputs; this server embeds at most"
            f" {MAX_EMBEDDING_INPUTS:,} per request; send them in several requests",
            param="input",
        )
    context = await request_context(request)
    runner = context.worker.runner
    try:
        return await run_in_threadpool(
            runner.embed, inputs, dimensions=dimensions, truncate=truncate
        )
    except ContextLengthError as error:
        raise ApiError(400, str(error), code="context_length_exceeded", param="input") from error
    except ModelNotSupportedError as error:  # named as the client named it
        raise ApiError(400, error.for_model(context.model_name), param="model") from error
    except NotSupportedError as error:
        raise ApiError(400, str(error), param="model") from error
    except ModelInputError as error:  # the one input checked against the model: dimensions
        raise ApiError(400, error.for_model(context.model_name), param="dimensions") from error
    except ValueError as error:
        raise ApiError(400, str(error), param="input") from error
